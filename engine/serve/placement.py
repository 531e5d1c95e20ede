"""Where an engine can run on this machine: the device a flag names (cpu, cuda, auto), why it cannot
run there (asked before anything is loaded or spawned, so a wrong --device ends in one sentence, not a
traceback), and on CUDA without a plan the plan of the fewest GPUs the checkpoint fits."""
from __future__ import annotations

import os
from pathlib import Path


def default_device() -> str:
    """`auto`: cuda when PyTorch sees a GPU, else cpu."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the engine on this machine, as one sentence; None when it can."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device: use cpu or cuda"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"--device {device!r} is not supported: use cpu or cuda"
    if not torch.cuda.is_available():
        return (f"--device {device} was asked for, but this machine has no CUDA GPU that PyTorch can use "
                f"(torch {torch.__version__}); run with --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
    return None


def gpu_memory() -> list[int]:
    """Total memory of each visible GPU in bytes, read with nvidia-smi (this process opens no CUDA
    context); [] when it cannot be read."""
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    sizes = [int(v) * 2 ** 20 for v in out.split() if v.strip().isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        sizes = [sizes[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(sizes)]
    return sizes


def fitting_plan(model: str | Path, dtype: str | None, quantize: str | None, verbose: bool,
                 cache_bytes: int = 0) -> str | None:
    """On CUDA with neither a plan nor a GPU count given: the plan of the fewest GPUs that fits, from the
    checkpoint's headers (engine/parallel/fit.py), with `cache_bytes` per rank for the conversation caches;
    PlanError saying what each plan needs when none does; None when the GPUs cannot be read."""
    from engine.parallel.fit import choose_plan
    from engine.checkpoint.shards import Checkpoint
    from engine.checkpoint.config import CheckpointConfig
    sizes = gpu_memory()
    if not sizes:
        return None
    dtype_bytes = 4 if dtype in ("float32", "fp32") else 2
    plan, est = choose_plan(Checkpoint(model), CheckpointConfig.load(model), len(sizes), min(sizes), quantize,
                            dtype_bytes=dtype_bytes, caches=cache_bytes)
    if verbose:
        print(f"engine: {len(sizes)} GPU(s) of {min(sizes) / 2 ** 30:.0f} GiB: plan {est.describe()}", flush=True)
    return plan.name
