"""A machine without Triton (PyTorch's CPU build brings none): every module of the program imports and the
embedded path runs end to end. Triton is hidden from child processes by a `triton` package on PYTHONPATH
that refuses to import, so the engine's own worker processes cannot see it either."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "hunyuan_kernels", "webui", "tools")

# Modules that are Triton kernels and nothing else: they are imported only once the registry has found
# Triton importable, and without it they must fail with ImportError for Triton, not for anything else.
TRITON_KERNEL_MODULES = {"hunyuan_kernels.moe.cuda", "hunyuan_kernels.moe.triton_kernels", "hunyuan_kernels.moe.gemm1",
                         "hunyuan_kernels.quant.cuda", "hunyuan_kernels.quant.moe_cuda",
                         "hunyuan_kernels.quant.triton_kernels", "hunyuan_kernels.quant.gemv",
                         "hunyuan_kernels.quant.humming"}

IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
ok, failed = [], {}
names = ["app"]
for pkg in %r:
    mod = importlib.import_module(pkg)
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")]
for name in names:
    try:
        importlib.import_module(name)
        ok.append(name)
    except BaseException as e:
        failed[name] = f"{type(e).__name__}: {e}"
import hunyuan_kernels as kernels
from hunyuan_kernels.registry import candidates
print(json.dumps({"ok": ok, "failed": failed,
                  "ops": {op: [i.backend for i in candidates(op, "cuda", None)] for op in kernels.ops()}}))
""" % (PACKAGES,)


def _env(tmp_path: Path) -> dict:
    stub = tmp_path / "no_triton" / "triton"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'triton\'", name="triton")\n')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), str(ROOT)])
    return env


def test_every_module_imports_without_triton(tmp_path):
    env = _env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "No module named 'triton'" in proc.stderr      # the stub hides it
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    unexpected = {k: v for k, v in res["failed"].items() if k not in TRITON_KERNEL_MODULES}
    assert not unexpected, unexpected
    for name in TRITON_KERNEL_MODULES:     # listed ones exist and fail for Triton alone
        assert res["failed"].get(name) == "ModuleNotFoundError: No module named 'triton'", (name, res["failed"])
    assert {"app", "engine.serve.server", "engine.runtime.engine", "webui.studio", "tools.tiny"} <= set(res["ok"])
    # every op is still there; with no Triton only its reference would run, on a GPU too
    assert {"moe", "moe_quant", "rms_norm", "sample", "decode_attention", "linear_mxfp4"} <= set(res["ops"])
    assert all(v == ["torch"] for v in res["ops"].values()), res["ops"]


def test_engine_generates_a_png_without_triton(tmp_path):
    env = _env(tmp_path)
    tiny, out = tmp_path / "tiny", tmp_path / "out.png"
    for argv in (["tools.tiny", str(tiny)],
                 ["engine", "generate", "--model", str(tiny), "--prompt", "a red circle", "--steps", "2", "--seed",
                  "3", "--max-new-tokens", "8", "--out", str(out)]):
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with Image.open(out) as im:
        assert im.format == "PNG" and min(im.size) > 0
