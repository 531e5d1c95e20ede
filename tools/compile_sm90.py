"""Compile the quantized Triton kernels (kernels/quant_triton.py) for the H200 (sm_90) on a machine
without a GPU, at the tile configs the launchers use, and print each one's registers, stack (spills)
and whether its MMA is Hopper's wgmma. Catches compile errors and register spills before a GPU run.

    python -m tools.compile_sm90 [linear grouped decode quantize]

Needs only Triton (its bundled ptxas / cuobjdump); nothing runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import quant_triton as qt

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CODES = {"mxfp8": "*fp8e4nv", "mxfp4": "*u8", "nvfp4": "*u8", "fp8": "*fp8e4nv"}
SCALES = {"mxfp8": "*u8", "mxfp4": "*u8", "nvfp4": "*fp8e4nv", "fp8": "*fp32"}


def compile_one(fn, sig: dict, consts: dict, warps: int, stages: int) -> dict:
    sig = dict(sig, **{k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return dict(regs=int(m.group(1)) if m else -1, stack=int(m.group(2)) if m else -1, wgmma="wgmma" in k.asm["ptx"])


def _split(cfg: dict) -> tuple[dict, int, int]:
    c = dict(cfg)
    return c, c.pop("num_warps"), c.pop("num_stages")


def cases(sections):
    for fmt in qt.FMT:
        base = dict(c_ptr=CODES[fmt], s_ptr=SCALES[fmt], g_ptr="*fp32")
        meta = dict(FMT=qt.FMT[fmt], INVERSE=fmt == "nvfp4", BS=qt.BLOCK[fmt], UPCAST=False)
        if "linear" in sections:
            sig = dict(x_ptr="*bf16", **base, out_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
                       stride_c="i32", stride_s="i32", stride_om="i32", k_split="i32")
            for name in ("LINEAR_LARGE", "LINEAR_MID", "LINEAR_SMALL"):
                c, w, st = _split(getattr(qt, name))
                out = "*fp32" if name == "LINEAR_SMALL" else "*bf16"          # the split-K partials
                yield f"linear {name} {fmt}", qt._linear_kernel, dict(sig, out_ptr=out), dict(meta, **c), w, st
        if "grouped" in sections:
            sig = dict(x_ptr="*bf16", **base, offs_ptr="*i32", out_ptr="*bf16", N="i32", K="i32", stride_xm="i32",
                       stride_cg="i32", stride_c="i32", stride_sg="i32", stride_s="i32", stride_gg="i32",
                       stride_om="i32", num_m="i32", G="i32")
            for name in ("GROUPED", "GROUPED_FEW"):
                c, w, st = _split(dict(qt.GROUPED, **qt.GROUPED_FMT.get(fmt, {})) if name == "GROUPED" else qt.GROUPED_FEW)
                yield f"grouped {name} {fmt}", qt._grouped_kernel, sig, dict(meta, G_PAD=64, **c), w, st
        if "decode" in sections:
            lead = dict(c_sm="i32", c_se="i32", c_sr="i32", s_sm="i32", s_se="i32", s_sr="i32", g_se="i32",
                        S="i32", SLOTS="i32")
            up = dict(x_ptr="*bf16", ids_ptr="*i32", active_ptr="*i32", **base, act_ptr="*bf16", N="i32", H="i32",
                      I="i32", stride_x="i32", **lead)
            down = dict(act_ptr="*bf16", ids_ptr="*i32", active_ptr="*i32", **base, y_ptr="*fp32", N="i32", H="i32",
                        I="i32", **lead, MC="i32")
            cu, wu, su = _split(dict(qt.DECODE_UP, **qt.DECODE_UP_FMT.get(fmt, {})))
            cd, wd, sd = _split(dict(qt.DECODE_DOWN, **qt.DECODE_DOWN_FMT.get(fmt, {})))
            for routed in (True, False):
                m = dict(meta, K=8, K_PAD=8, BLOCK_N=16, ROUTED=routed)
                yield f"decode_up routed={routed} {fmt}", qt._qdecode_up_kernel, up, dict(m, **cu), wu, su
                yield f"decode_down routed={routed} {fmt}", qt._qdecode_down_kernel, down, dict(m, **cd), wd, sd
    if "quantize" in sections:
        for fake in (False, True):
            sig = dict(x_ptr="*bf16", q_ptr="*bf16" if fake else "*fp8e4nv", s_ptr="*fp32", K="i32", stride_x="i32",
                       stride_q="i32")
            yield f"quantize_rows fake={fake}", qt._quantize_rows_kernel, sig, dict(FAKE=fake, BLOCK=4096), 8, 3
        yield "sum_splits", qt._sum_splits_kernel, dict(p_ptr="*fp32", out_ptr="*bf16", MN="i32"), dict(
            SPLITS=4, BLOCK=1024), 4, 3


def main(argv: list[str]) -> int:
    sections = set(argv) or {"linear", "grouped", "decode", "quantize"}
    bad = 0
    for name, fn, sig, consts, warps, stages in cases(sections):
        try:
            r = compile_one(fn, sig, consts, warps, stages)
        except Exception as e:  # noqa: BLE001 - report every kernel that does not compile
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:1500]}")
            bad += 1
            continue
        spill = " SPILLS" if r["stack"] else ""
        print(f"ok    {name:<36} regs {r['regs']:>3}  stack {r['stack']:>4}  wgmma {r['wgmma']}{spill}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
