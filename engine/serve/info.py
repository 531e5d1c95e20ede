"""What a client needs to know about the served checkpoint, read from its small files only (no weights),
so the UI can build its controls and validate input while the engine is still loading."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from engine.runtime.request import Prepared, Request, prepare, with_seed
from engine.checkpoint.buckets import Bucket, build_buckets
from engine.checkpoint.config import CheckpointConfig, GenerationConfig, ModelConfig
from engine.checkpoint.prompts import PRESETS, SystemPrompts


@dataclass(frozen=True)
class ModelInfo:
    """What a client needs to build its controls and validate input, read from the checkpoint's small
    files only (no weights), so the UI can come up while the engine is still loading."""
    folder: Path
    name: str
    gen: GenerationConfig
    buckets: tuple[Bucket, ...]
    presets: tuple[str, ...]          # system-prompt presets usable with this checkpoint
    distil: bool
    cfg: ModelConfig

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelInfo":
        folder = Path(folder)
        cc = CheckpointConfig.load(folder)
        prompts = SystemPrompts.load(folder)
        # presets whose text the folder provides, plus the ones that need none
        usable = tuple(p for p in PRESETS if p in prompts.texts or p in ("dynamic", "custom", "None"))
        return cls(folder, cc.model.model_version or folder.name, cc.generation,
                   build_buckets(cc.model.image_base_size), usable, cc.model.cfg_distilled, cc.model)

    def prepare(self, req: Request, adapters: Collection[str] = (), merged: tuple[str, float] | None = None
                ) -> Prepared:
        """The request (its seed fixed: `with_seed`) checked and its defaults resolved, as the engine runs
        it (`adapters`: the LoRA adapters it serves, `merged`: the one merged into its weights); RequestError
        otherwise (one implementation: `request.prepare`)."""
        return prepare(req, self, adapters, merged)

    def validate(self, req: Request, adapters: Collection[str] = (), merged: tuple[str, float] | None = None) -> None:
        """Raise RequestError exactly as the engine would (a form's check before it submits)."""
        self.prepare(with_seed(req), adapters, merged)
