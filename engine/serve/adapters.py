"""The checks on serving a LoRA adapter, shared by one engine (EngineServer) and the ingress of engine
replicas (ReplicaPool), so both refuse the same adapters with the same words (ValueError / KeyError)."""
from __future__ import annotations

from pathlib import Path
from typing import Collection

from engine.serve.info import ModelInfo

Loras = tuple[tuple[str, str], ...]          # (name, PEFT folder) of each adapter served, in load order


def needs_mlp(loras: Loras, merged: bool = False) -> bool:
    """Whether adapter tables must hold the MLPs for these adapters loaded at start (one of them adapts the
    MLPs; read from the files' headers). A merged adapter needs no tables."""
    from engine.model.peft import adapted_modules
    from engine.checkpoint.names import MLP_LINEARS
    return not merged and any(m.endswith(MLP_LINEARS) for _, folder in loras for m in adapted_modules(folder))


def check_adapter(info: ModelInfo, name: str, folder: str, max_rank: int, merged: bool = False,
                  mlp: bool = False) -> None:
    """Refuse (ValueError naming why) an adapter the engine could not load: read here, as every rank will.
    `merged`: folded into the weights at load (more targets; no slot, so no rank limit); `mlp`: the tables
    hold the MLPs too."""
    from engine.model.peft import ALL_TARGETS, TARGETS, read_peft
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ValueError(f"a LoRA adapter needs a name without '/' (got {name!r})")
    adapter = read_peft(folder, info.cfg, targets=ALL_TARGETS if merged or mlp else TARGETS)
    if adapter.rank > max_rank and not merged:
        raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, above the engine's max LoRA rank {max_rank}")


def check_load(info: ModelInfo, loras: Loras, slots: int, max_rank: int, name: str, folder: str | Path,
               mlp: bool = False) -> str:
    """The absolute folder of an adapter that may be loaded beside `loras` into `slots` slots (of the MLPs
    too with `mlp`); ValueError when it cannot be: no free slot, a name in use, or a folder that is not a
    servable adapter."""
    folder = str(Path(folder).resolve())
    if not slots:
        raise ValueError("this engine has no LoRA adapter slots (start it with --max-loras N or --lora)")
    if name in (n for n, _ in loras):
        raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
    if len(loras) >= slots:
        raise ValueError(f"all {slots} LoRA adapter slots are in use; unload one first")
    check_adapter(info, name, folder, max_rank, mlp=mlp)
    return folder


def check_unload(loras: Loras, name: str, users: Collection[str]) -> Loras:
    """`loras` without `name`; KeyError when it is not loaded, ValueError while requests (`users`, their ids)
    that use it are queued or running."""
    if name not in (n for n, _ in loras):
        raise KeyError(f"no LoRA adapter named {name!r} is loaded")
    if users:
        raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); unload it when they end")
    return tuple(a for a in loras if a[0] != name)
