"""Input controls that pass on what they receive, unchecked.

Gradio's own Slider, Number, Radio and Dropdown refuse an out-of-range number or an unknown choice while
preprocessing, before the event's validator runs; the API client then sees a bare `400 Bad Request` and
the page a generic error. `lenient` makes a control hand the raw value to the validator instead, where
the engine's `prepare` (the one judge of a request) names the field and its valid range. The browser
draws the control as usual (its own bounds and choices still guide a person).

It replaces `preprocess` on the instance: a subclass of a Gradio component would make Gradio write a
.pyi stub file next to this module at import.
"""
from __future__ import annotations

from typing import Any, TypeVar

import gradio as gr

C = TypeVar("C", bound=gr.components.Component)


def _as_sent(payload: Any) -> Any:
    return payload


def lenient(component: C) -> C:
    """`component`, preprocessing nothing: its event functions get the value as the client sent it."""
    component.preprocess = _as_sent        # type: ignore[method-assign]
    return component
