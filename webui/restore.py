"""A PNG's record (engine/serve/image_meta.py) as the page's controls: what "Open a PNG's settings" puts back,
so that Generate makes the same image again (the same seed gives the same pixels). Pure functions; what the
page can take of it is the studio's to judge (Studio.applicable)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .options import AUTO_SIZE, NO_LORA, STEP_CACHES


@dataclass
class Restored:
    prompt: str
    edit: bool                                  # made from reference images: the edit tab's instruction
    settings: dict[str, Any]                    # Settings.NAMES -> value
    notes: list[str] = field(default_factory=list)   # what the page cannot give back, and why


def restored(record: dict[str, Any], model: str, kernels: str | None = None) -> Restored:
    """The prompt and the settings of a record, in the page's terms (its size as the page's W:H choice, its
    seed fixed, its step cache by the page's names). `kernels`: what multiplies this engine's quantized weights
    (health's words, "" for ours; None: unknown), against the record's."""
    s: dict[str, Any] = {"seed": record.get("seed"), "random_seed": False}
    for name in ("mode", "steps", "guidance", "system_prompt", "max_new_tokens", "lora_scale"):
        if name in record:
            s[name] = record[name]
    s["custom_system_prompt"] = record.get("custom_system_prompt") or ""
    s["lora"] = record.get("lora") or NO_LORA
    asked, size = record.get("size_asked"), str(record.get("size") or "")
    if asked == AUTO_SIZE:
        s["size"] = AUTO_SIZE
    elif "x" in size:              # a fixed size: the bucket it ran at (width x height -> the page's W:H)
        w, _, h = size.partition("x")
        s["size"] = f"{w}:{h}"
    notes = []
    cache = record.get("step_cache")
    if cache in [v for _, v in STEP_CACHES]:
        s["step_cache"] = cache
    elif cache is not None:
        notes.append(f"its step cache ({cache}: {record.get('taylor_cache') or record.get('block_cache')}) is not "
                     "one the page offers")
    if record.get("model") and record["model"] != model:
        notes.append(f"it was made by {record['model']}, this studio serves {model}: the image will differ")
    made = record.get("kernels") or ""
    if kernels is not None and "kernels" in record and made != kernels:
        notes.append(f"it was made with {made or 'our kernels'}, this engine runs {kernels or 'our kernels'}: the "
                     "pixels will differ slightly")
    refs = int(record.get("references") or 0)
    if refs:
        notes.append(f"it was an edit of {refs} image{'s' if refs != 1 else ''}: add {'them' if refs != 1 else 'it'} "
                     "as references")
    if record.get("infer_align_image_size"):
        notes.append("it kept its first reference's aspect: tick “Keep the first reference's aspect” on the edit "
                     "tab")
    return Restored(str(record.get("prompt") or ""), bool(refs), s, notes)
