"""Look of the studio. The theme uses only local fonts (the default theme's), so the page makes no
request outside the server: it works offline, behind share links and on locked-down machines."""
from __future__ import annotations

import gradio as gr

CSS = """
/* Wide screens: prompt above settings on the left, the run on the right across both. Narrow screens
   keep the row's stacking in source order: prompt, run, settings. */
@media (min-width: 1000px) {
  #layout { display: grid !important; grid-template-columns: 5fr 6fr; grid-template-rows: auto 1fr;
            align-items: start; }
  #col-prompt { grid-column: 1; grid-row: 1; }
  #col-run { grid-column: 2; grid-row: 1 / span 2; }
  #col-settings { grid-column: 1; grid-row: 2; }
}
/* The canvas: the whole image, as large as the box allows (small images are drawn up, not cropped).
   The run column starts at the top of the page (the heading is in the left column): the status and the
   reasoning above the canvas, Download and the timings below it, all on one screen, 1440x900 and a
   390x844 phone (once Generate has scrolled to the run). */
#result { height: min(512px, max(260px, calc(100vh - 430px))) !important; }
#result-actions { flex-wrap: nowrap !important; align-items: stretch; }
#result-actions > * { min-width: 0 !important; }
/* the result's link, beside Download and Edit: a plain link drawn as a quiet button */
#download, #edit-result { flex: 1 1 0 !important; }
#result-link { flex: 0 0 auto !important; width: auto !important; display: flex; align-items: center; }
.result-link { display: inline-block; padding: 0 0.75em; white-space: nowrap; font-weight: 600;
               color: var(--link-text-color, var(--color-accent)); }
.result-link.off { opacity: 0.45; color: var(--body-text-color-subdued); }
/* narrow screens (after the rules above, which it overrides): the canvas gives up more height (on a 390x844
   phone the status, six lines of reasoning, Download, the link and four lines of timings take 540 px around
   it), the link goes under Download and Edit */
@media (max-width: 999px) { #result { height: max(220px, calc(100vh - 580px)) !important; }
                            #result-actions { flex-wrap: wrap !important; }
                            #result-link { flex: 1 0 100% !important; } }
#title h1 { margin: 0; }
#result img { width: 100%; height: 100%; object-fit: contain; }
#result .image-container, #result .image-frame { width: 100%; height: 100%; }
/* Reference images and the history strip: square tiles, each image whole inside its tile. Gradio
   gives few images the whole width (one reference became a 500 px tile cut by the 220 px box). */
#refs .grid-container { grid-template-columns: repeat(3, minmax(0, 1fr)) !important; }
#history .grid-container { grid-template-columns: repeat(auto-fill, minmax(110px, 1fr)) !important; }
#refs .grid-container, #history .grid-container { grid-template-rows: none !important;
                                                  grid-auto-rows: auto !important; }
#refs .thumbnail-item, #history .thumbnail-item { aspect-ratio: 1 / 1; height: auto !important; }
#history .grid-wrap { min-height: 0 !important; }
/* The example edits' table fits a phone (its header and instructions wrap; it was cut at the right). */
#edit-examples table { table-layout: fixed; width: 100%; }
#edit-examples th, #edit-examples td { white-space: normal !important; overflow-wrap: anywhere; }
/* Gradio hides "Use via API" below 640 px; the API is the same on a phone. (Not in a media query: Gradio
   scopes those to the app's body, and the footer is outside it; elsewhere the link is shown this way anyway.) */
footer .show-api { display: flex !important; }
/* A message under a control wraps anywhere (a long file name must not push it past the panel). */
.validation-error { overflow-wrap: anywhere; }
.range-note { color: var(--error-text-color, #b91c1c); font-size: var(--text-sm); margin-top: 4px; }
/* Stop is red only while it can stop something (its variant follows the run). */
#stop button:disabled, #ti2i-stop:disabled, #stop:disabled { opacity: 0.6; }
#engine-health, #engine-health .html-container { padding: 0 !important; }
#status textarea { font-variant-numeric: tabular-nums; font-weight: 600; }
#cot textarea { font-family: var(--font-mono); font-size: 0.85em; }
#timings { font-variant-numeric: tabular-nums; min-height: 1.5em; }
#notice { border-left: 4px solid var(--color-accent); padding-left: 0.75em; }
#engine-health { opacity: 0.85; font-size: 0.9em; }
/* The edit tab's thread: one turn a row, its image whole in a small box beside its text. */
.turn { border-bottom: 1px solid var(--border-color-primary); padding-bottom: 6px; }
.turn-image img { object-fit: contain; }
.turn-refs, .thread-hint, #thread-cut { opacity: 0.8; font-size: 0.9em; }
"""


def theme() -> gr.themes.Base:
    return gr.themes.Default(primary_hue="indigo", secondary_hue="slate", neutral_hue="slate")
