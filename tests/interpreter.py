"""Running a test file's `test_interp_*` tests under Triton's CPU interpreter: TRITON_INTERPRET=1 must
be set before Triton is first imported (its own library functions are decorated then), so they run in
a child pytest with it set. Shared by the kernel test files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]


def run_interpreter_suite(test_file: str) -> None:
    import triton  # noqa: F401  (a test dependency: a missing Triton fails here, it never skips the suite)
    if INTERPRETED:
        pytest.skip("this is the child run")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
                           "-k", "test_interp_"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
