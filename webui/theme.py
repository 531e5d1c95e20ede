"""Look of the studio. The theme uses only local fonts (the default theme's), so the page makes no
request outside the server: it works offline, behind share links and on locked-down machines."""
from __future__ import annotations

import gradio as gr

CSS = """
#status textarea { font-variant-numeric: tabular-nums; font-weight: 600; }
#cot textarea { font-family: var(--font-mono); font-size: 0.85em; }
#timings { font-variant-numeric: tabular-nums; min-height: 1.5em; }
#notice { border-left: 4px solid var(--color-accent); padding-left: 0.75em; }
#engine-health { opacity: 0.8; font-size: 0.9em; }
"""


def theme() -> gr.themes.Base:
    return gr.themes.Default(primary_hue="indigo", secondary_hue="slate", neutral_hue="slate")
