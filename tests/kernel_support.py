"""What the kernel tests share: the interpreter child run, its set-up, poisoned scratch, the error
measure.

Triton's CPU interpreter needs TRITON_INTERPRET=1 before Triton is first imported (its own library
functions are decorated then), so each kernel test file's `test_interp_*` tests run in a child pytest
with it set (`run_interpreter_suite`); there `interpreted(...)` prepares the interpreter and imports the
kernel module under test."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hunyuan_kernels.scratch import poisoned as poisoned_scratch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64."""
    want = want.to(torch.float64)
    return ((got.to(torch.float64) - want).norm() / want.norm()).item()


def run_interpreter_suite(test_file: str) -> None:
    import triton  # noqa: F401  (a test dependency: a missing Triton fails here, it never skips the suite)
    if INTERPRETED:
        pytest.skip("this is the child run")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
                           "-k", "test_interp_"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def interpreted(module: str | None = None) -> ModuleType | None:
    """In the child run: the interpreter prepared (hunyuan_kernels._triton.prepare_interpreter) and `module`
    imported, asserted to run under the interpreter. Outside it the test is skipped (the parent's
    `test_triton_interpreter_suite` runs it)."""
    if not INTERPRETED:
        pytest.skip("runs in the child pytest of test_triton_interpreter_suite (TRITON_INTERPRET=1)")
    from hunyuan_kernels._triton import INTERPRET, prepare_interpreter
    assert INTERPRET
    prepare_interpreter()
    return importlib.import_module(module) if module else None


def poisoned(fn, *args, **kwargs):
    """fn(*args, **kwargs) with every scratch buffer starting as NaN: a read before a write shows up."""
    with poisoned_scratch():
        return fn(*args, **kwargs)
