"""System-prompt presets, read as data from the checkpoint's `system_prompt.py`.

The file is parsed with `ast` and only string constants are taken from it; nothing in the
checkpoint folder is ever imported or executed. Presets follow the official `get_system_prompt`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# The official `bot_task` values: what the model writes before the image (image: nothing but the size;
# think / recaption / think_recaption: a chain of thought; auto: free text, no image).
BOT_TASKS = ("image", "recaption", "think", "think_recaption", "auto")
COT_TASKS = ("think", "recaption", "think_recaption")        # the tasks whose text goes into the image stage

PRESETS = ("en_unified", "en_vanilla", "en_recaption", "en_think_recaption", "dynamic", "custom", "None")

# preset name -> module-level variable that holds its text in the official file
_VARIABLES = {
    "en_unified": "unified_system_prompt_en",
    "en_vanilla": "t2i_system_prompt_en_vanilla",
    "en_recaption": "t2i_system_prompt_en_recaption",
    "en_think_recaption": "t2i_system_prompt_en_think_recaption",
}


class PromptError(ValueError):
    field = "system_prompt"           # the request field at fault (Error.param)


def _string_constants(source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            out[node.targets[0].id] = node.value.value
    return out


@dataclass(frozen=True)
class SystemPrompts:
    texts: dict[str, str]          # preset -> raw text (unstripped)
    source: Path | None            # where they were read from; None when the folder has no file

    @classmethod
    def load(cls, folder: str | Path) -> "SystemPrompts":
        folder = Path(folder)
        for candidate in (folder / "system_prompt.py", folder / "hunyuan_image_3" / "system_prompt.py"):
            if candidate.exists():
                try:
                    consts = _string_constants(candidate.read_text(encoding="utf-8"))
                except (SyntaxError, UnicodeDecodeError, OSError) as e:
                    raise PromptError(f"cannot parse {candidate}: {e}") from None
                return cls({p: consts[v] for p, v in _VARIABLES.items() if v in consts}, candidate)
        return cls({}, None)

    def resolve(self, preset: str, bot_task: str, custom: str | None = None) -> str:
        """The system prompt text for a request, stripped as the Instruct code does ('' = none)."""
        if preset not in PRESETS:
            raise PromptError(f"unknown system prompt preset {preset!r}; choose one of {', '.join(PRESETS)}")
        if preset == "None":
            return ""
        if preset == "custom":
            return (custom or "").strip()
        if preset == "dynamic":
            # Official mapping by task; think_recaption is mapped like think (the official code falls
            # through to the custom text there, which is empty unless given).
            task = bot_task.split("_")[0]
            preset = {"think": "en_think_recaption", "recaption": "en_recaption", "image": "en_vanilla"}.get(task, "")
            if not preset:
                return (custom or "").strip()
        if preset not in self.texts:
            where = self.source or "the model folder (no system_prompt.py)"
            raise PromptError(f"system prompt preset {preset!r} is not available in {where}; "
                              "use --system-prompt None or custom")
        return self.texts[preset].strip()
