"""Compile the quantized Triton kernels (hunyuan_kernels/quant/triton_kernels.py, gemv.py) for the H200
(sm_90) on a machine without a GPU, at the tile configs the launchers use, and print each one's
registers, stack (spills) and whether its MMA is Hopper's wgmma. Catches compile errors and register
spills before a GPU run.

    python -m tools.compile_sm90 [linear grouped quantize gemv]

`gemv` (gemv.py) also prints each innermost loop's SASS instruction count and any shared-memory
traffic / barrier in it (a layout conversion the GEMV design must not have).

Needs only Triton (its bundled ptxas / cuobjdump); nothing runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hunyuan_kernels.quant import triton_kernels as qt
    TARGET = GPUTarget("cuda", 90, 32)
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
except ImportError:     # the module still imports (tests walk every module); main() says what is missing
    triton = None
CODES = {"mxfp8": "*fp8e4nv", "mxfp4": "*u8", "nvfp4": "*u8", "fp8": "*fp8e4nv"}
SCALES = {"mxfp8": "*u8", "mxfp4": "*u8", "nvfp4": "*fp8e4nv", "fp8": "*fp32"}


def compile_one(fn, sig: dict, consts: dict, warps: int, stages: int, aligned: tuple[str, ...] = ()) -> dict:
    """aligned: arguments the launcher's JIT would see as multiples of 16 (pointers, strides)."""
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in fn.arg_names}
    sig = dict(sig, **{k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return dict(regs=int(m.group(1)) if m else -1, stack=int(m.group(2)) if m else -1, wgmma="wgmma" in k.asm["ptx"],
                loops=loop_counts(sass))


def loop_counts(sass: str) -> list[dict]:
    """Per innermost loop of the SASS (a backward branch to a label): its instruction count and how many
    are shared-memory traffic or barriers (a layout conversion left inside the loop)."""
    addr, labels, branches = [], {}, []
    pending = None
    for line in sass.splitlines():
        lab = re.match(r"\s*(\.L_x_\d+):", line)
        if lab:
            pending = lab.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        a, text = int(m.group(1), 16), m.group(2)
        if pending:
            labels[pending], pending = a, None
        addr.append((a, text))
        b = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if b:
            branches.append((a, b.group(1)))
    loops = [(labels[t], a) for a, t in branches if t in labels and labels[t] < a]
    inner = [(lo, hi) for lo, hi in loops if not any(lo < lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi)
                                                     for lo2, hi2 in loops)]
    out = []
    for lo, hi in inner:
        body = [t for a, t in addr if lo <= a <= hi]
        smem = sum(bool(re.search(r"\b(STS|LDS|BAR|LDSM|STSM)\b", t)) for t in body)
        local = sum(bool(re.search(r"\b(STL|LDL)\b", t)) for t in body)
        out.append(dict(instructions=len(body), smem=smem, local=local))
    return out


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
        if "gemv" in sections:
            yield from gemv_cases(fmt, base)
    if "quantize" in sections:
        for fake in (False, True):
            sig = dict(x_ptr="*bf16", q_ptr="*bf16" if fake else "*fp8e4nv", s_ptr="*fp32", K="i32", stride_x="i32",
                       stride_q="i32")
            yield f"quantize_rows fake={fake}", qt._quantize_rows_kernel, sig, dict(FAKE=fake, BLOCK=4096), 8, 3
        yield "sum_splits", qt._sum_splits_kernel, dict(p_ptr="*fp32", out_ptr="*bf16", MN="i32"), dict(
            SPLITS=4, BLOCK=1024), 4, 3
    if "gemv" in sections:                       # the FP8 GEMVs' W8A8 prep: a row read once (K 4096, 16384), twice
        from hunyuan_kernels.quant import gemv as qg
        sig = dict(x_ptr="*bf16", out_ptr="*fp32", KW="i32", stride_x="i32", stride_o="i32")
        for one, bw, warps in ((True, 1024, 8), (True, qg.FP8_PREP_ONE_PASS_WORDS, 8), (False, 512, 4)):
            yield (f"gemv_prep_fp8 one_pass={one} BW={bw}", qg._prep_fp8_kernel, sig,
                   dict(PH_=4, BW=bw, ONE_PASS=one), warps, 3, ("x_ptr", "out_ptr"))


def gemv_cases(fmt: str, base: dict):
    """quant_gemv's kernels at the launchers' tiles: every token bucket is compiled into each kernel."""
    from hunyuan_kernels.quant import gemv as qg
    base = dict(base, c_ptr="*i32")
    cw = qg._chunk_words(fmt)
    meta = dict(FMT=qg.FMT[fmt], INVERSE=fmt == "nvfp4", CW=cw, EVEN_K=True)
    aligned = ("x_ptr", "c_ptr", "s_ptr", "act_ptr", "y_ptr", "out_ptr", "KW", "stride_x", "stride_c", "stride_s",
               "stride_o", "c_sm", "c_se", "c_sr", "s_sm", "s_se", "s_sr", "I", "H")
    xt = "*fp32"                           # decode_up reads x prepared by gemv.prep
    lead = dict(c_sm="i32", c_se="i32", c_sr="i32", s_sm="i32", s_se="i32", s_sr="i32", g_se="i32", SLOTS="i32")
    ph = qg.act_ph(fmt)
    up = dict(x_ptr=xt, ids_ptr="*i32", active_ptr="*i32", **base, act_ptr="*fp32" if ph else "*bf16", N="i32",
              I="i32", KW="i32", stride_x="i32", **lead)
    down = dict(act_ptr="*fp32" if ph else "*bf16", ids_ptr="*i32", active_ptr="*i32", **base, y_ptr="*fp32",
                N="i32", H="i32", I="i32", KW="i32", **lead, MC="i32")
    cu = dict(qg.DECODE_UP, **qg.DECODE_UP_FMT.get(fmt, {}))
    cd = dict(qg.DECODE_DOWN, **qg.DECODE_DOWN_FMT.get(fmt, {}))
    for routed, max_t in ((True, 1), (True, 2), (True, 4), (False, 2)):       # 1 token; 2 / 4 tokens a pass
        m = dict(meta, K=8, K_PAD=8, BLOCK_N=8, N_PAD=8, ROUTED=routed, MAX_T=max_t)
        wu = cu["num_warps"]
        yield (f"gemv_up routed={routed} T<={max_t} {fmt}", qg._gemv_up_kernel, up,
               dict(m, BI=cu["BI"], G=cu["G"], PREP=True, ACT_PH=ph), wu, 1, aligned)
        yield (f"gemv_down routed={routed} T<={max_t} {fmt}", qg._gemv_down_kernel, down,
               dict(m, R=cd["R"], G=cd["G"], PREP=bool(ph)), cd["num_warps"], 1, aligned)
    lin = dict(x_ptr="*fp32" if qg.LINEAR["PREP"] else "*bf16", **base, out_ptr="*bf16", M="i32", N="i32", KW="i32",
               stride_x="i32", stride_c="i32", stride_s="i32", stride_o="i32")
    for tb in (1, 2, 4):
        yield (f"gemv_linear TB={tb} {fmt}", qg._linear_kernel, lin,
               dict(meta, TB=tb, R=qg.LINEAR["R"], G=qg.LINEAR["G"], PREP=qg.LINEAR["PREP"]),
               qg.LINEAR["num_warps"], 1, aligned)


def main(argv: list[str]) -> int:
    if triton is None:
        print("error: tools.compile_sm90 needs Triton (pip install triton)", file=sys.stderr)
        return 2
    sections = set(argv) or {"linear", "grouped", "quantize", "gemv"}
    bad = 0
    for name, fn, sig, consts, warps, stages, *aligned in cases(sections):
        try:
            r = compile_one(fn, sig, consts, warps, stages, *aligned)
        except Exception as e:  # noqa: BLE001 - report every kernel that does not compile
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:1500]}")
            bad += 1
            continue
        spill = " SPILLS" if r["stack"] else ""
        loops = " ".join(f"{lp['instructions']}" + (f"(smem {lp['smem']})" if lp["smem"] else "")
                         + (f"(local {lp['local']})" if lp["local"] else "") for lp in r["loops"])
        print(f"ok    {name:<36} regs {r['regs']:>3}  stack {r['stack']:>4}  wgmma {r['wgmma']}{spill}"
              f"  inner loops: {loops}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
