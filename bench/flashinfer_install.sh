#!/usr/bin/env bash
# FlashInfer 0.7.4 for the GPU machine, which reaches no package index and takes at most 64 MiB a call with
# the working tree (~29 MiB) included, while FlashInfer's wheel alone is 97 MiB.
#
#   bash bench/flashinfer_install.sh prepare [site|moe...]   # here (pip, xz; ~10 min of xz on 2 busy cores for
#                                                # site): writes .fi/parts/fi-<bundle>.tar.xz.part-* and
#                                                # .fi/parts/fi-<bundle>.sha256; a bundle whose parts are there
#                                                # and whole is kept (FI_REBUILD=1 rebuilds it)
#   source bench/flashinfer_install.sh install   # there: unpacks the bundles carried into .fi/site once each,
#                                                # exports the environment (PYTHONPATH, the JIT cache .fi/ws)
#   bash bench/flashinfer_install.sh warm [fam...]     # there: JIT-builds the families (default: the four our
#                                                # ops use) in parallel and waits up to FI_BUILD_TIMEOUT (240 s)
#   bash bench/flashinfer_install.sh warm-bg [fam...]  # there: starts the builds (default: all five) in their
#                                                # own session at nice 10 and returns; they go on across calls
#   bash bench/flashinfer_install.sh wait [seconds]    # there: waits (default 0 s) for every family started,
#                                                # prints each one's rc and seconds, tails the failed logs
#   bash bench/flashinfer_install.sh save        # there, after the builds: the built modules as the `aot`
#                                                # bundle's parts under $OUT; copied here into .fi/parts, later
#                                                # calls (and sessions) carry them and build nothing
#
# Bundles. site: flashinfer-python 0.7.4 and what it imports that the GPU image lacks (apache-tvm-ffi, cuda-tile,
# nccl4py; the image has torch, numpy, ninja, einops, click, tabulate, tqdm, requests, nvidia-ml-py,
# cuda-bindings), downloaded without dependencies. Left out: nccl-extensions (23 MB) and nvidia-cudnn-frontend
# (12 MB); FlashInfer imports `nccl.ep` only inside its expert-parallel MoE and `cudnn` under try/except.
# The wheels are unpacked as `pip install --no-deps --target` would (a wheel is a zip of the installed files),
# leaving out of FlashInfer's the kernel sources no build of ours reads: the subfolders of flashinfer/data/csrc
# (other families: cake_*, fused_moe, kda, ...) and the .cu/.cuh files outside flashinfer/data. Kept: every
# Python file, flashinfer/data/{include,cutlass,cccl,spdlog} and csrc's own files (the norm, sampling, top-k
# and batch-decode sources with their bindings and templates). xz takes the 205 MB to ~23 MB: one part.
# moe: what the SM90 CUTLASS fused MoE's JIT spec reads on top of site (flashinfer/jit/fused_moe.py,
# gen_cutlass_fused_moe_module: its sources and include dirs are csrc/fused_moe/cutlass_backend and
# csrc/nv_internal, which also holds the DeepGEMM headers it compiles at run time); the CUTLASS instantiations
# it generates come from flashinfer/jit/gemm (Python, in site). ~4 MB of sources, <1 MB as xz.
# aot: the modules built on the GPU machine (`save`), each as flashinfer/data/aot/<name>/<name>.so, the
# path FlashInfer 0.7 loads a module from without building it (flashinfer/jit/env.py get_aot_artifacts):
# JIT-built once (the top-k and fused-MoE modules took more than 16 minutes), carried from then on.
# Parts are PART_MB (30) MB at most, so a call can carry them beside the tree.
#
# On the GPU machine each call runs in a fresh copy of the tree, but ignored paths already there stay while
# the machine is warm: .fi/site, the JIT cache .fi/ws and the build logs .fi/warm survive between warm calls,
# and so do builds started by warm-bg (their own session: the call that started them may end). Carry only
# .fi/parts (or, per call, one bundle's sha256 and parts).
FI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FI_DIR=$FI_ROOT/.fi
FI_WARM=$FI_DIR/warm
FI_BUNDLES=(site moe aot)
FI_WHEELS=(flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 nccl4py==0.6.0)

fi_whole() {   # fi_whole BUNDLE: the bundle's parts are there and make the file its sha256 names
  local want
  want=$(cat "$FI_DIR/parts/fi-$1.sha256" 2>/dev/null) || return 1
  [ "$(cat "$FI_DIR/parts/fi-$1.tar.xz.part-"* 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$want" ]
}

fi_prepare() {
  local py=${PYTHON:-python3} b
  [ $# -gt 0 ] || set -- site moe             # (aot is made on the GPU machine: `save`)
  mkdir -p "$FI_DIR/wheels" "$FI_DIR/parts" || return 1
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$FI_DIR/wheels" "${FI_WHEELS[@]}" || return 1
  for b in "$@"; do
    if [ "${FI_REBUILD:-0}" != 1 ] && fi_whole "$b"; then
      echo "fi-$b: kept (whole; FI_REBUILD=1 rebuilds)"; continue
    fi
    rm -rf "$FI_DIR/build" "$FI_DIR/parts/fi-$b".* && mkdir -p "$FI_DIR/build/site" || return 1
    "$py" - "$FI_DIR" "$b" <<'EOF' || return 1
import pathlib, sys, zipfile
fi, bundle = pathlib.Path(sys.argv[1]), sys.argv[2]
CSRC = "flashinfer/data/csrc/"
MOE = (CSRC + "fused_moe/cutlass_backend/", CSRC + "nv_internal/")   # the SM90 CUTLASS fused MoE's JIT spec

def site(n: str) -> bool:
    if n.startswith(CSRC):
        return "/" not in n[len(CSRC):]              # csrc's own files; its subfolders are other families
    return n.startswith("flashinfer/data/") or not n.endswith((".cu", ".cuh"))

def moe(n: str) -> bool:
    return n.startswith(MOE)

wheels = {"site": ("flashinfer_python-0.7.4-", "apache_tvm_ffi-0.1.15.post2-", "cuda_tile-1.7.0-", "nccl4py-0.6.0-"),
          "moe": ("flashinfer_python-0.7.4-",)}[bundle]
kept = {"site": site, "moe": moe}[bundle]
for prefix in wheels:
    (wheel,) = fi.glob(f"wheels/{prefix}*.whl")
    z = zipfile.ZipFile(wheel)
    keep = [n for n in z.namelist() if kept(n)]
    z.extractall(fi / "build" / "site", keep)
    print(f"fi-{bundle}: {wheel.name}: {len(keep)} of {len(z.namelist())} files")
EOF
    # fixed order, owners and times: the same wheels give the same bytes (and sha256)
    tar -C "$FI_DIR/build" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - site \
      | xz -6 -T2 > "$FI_DIR/fi-$b.tar.xz" || return 1
    sha256sum "$FI_DIR/fi-$b.tar.xz" | cut -d' ' -f1 > "$FI_DIR/parts/fi-$b.sha256"
    split -b "${PART_MB:-30}m" "$FI_DIR/fi-$b.tar.xz" "$FI_DIR/parts/fi-$b.tar.xz.part-"
    rm -rf "$FI_DIR/build" "$FI_DIR/fi-$b.tar.xz"
  done
  ls -l "$FI_DIR/parts"
  echo "carry: .fi/parts (all bundles), or per call .fi/parts/fi-<bundle>.sha256 with that bundle's parts"
}

fi_env() {   # the environment every FlashInfer process here needs (the same JIT cache in every call)
  # FLASHINFER_USE_CUDA_NORM: its CUDA norm kernels (the CuTe DSL ones need nvidia-cutlass-dsl, not carried)
  export PYTHONPATH=$FI_DIR/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=$FI_DIR/ws \
    FLASHINFER_USE_CUDA_NORM=1 MAX_JOBS=${MAX_JOBS:-16}
  mkdir -p "$FI_DIR/ws"
}

fi_install() {   # each bundle carried is unpacked once (its sha256 recorded in .fi/site); site is required
  local b want
  for b in "${FI_BUNDLES[@]}"; do
    want=$(cat "$FI_DIR/parts/fi-$b.sha256" 2>/dev/null) || {
      [ "$b" = site ] && { echo "no .fi/parts/fi-site.sha256: carry .fi/parts"; return 1; }
      [ -f "$FI_DIR/site/.$b.sha256" ] || [ "$b" = aot ] || echo "fi-$b: not carried (its families will not build)"
      continue; }
    [ "$(cat "$FI_DIR/site/.$b.sha256" 2>/dev/null)" = "$want" ] && continue
    if ! fi_whole "$b"; then
      echo "the parts under .fi/parts do not make fi-$b.tar.xz (one missing?):"; ls -l "$FI_DIR/parts"; return 1
    fi
    [ "$b" = site ] && rm -rf "$FI_DIR/site"      # a new base: every bundle is unpacked again on top of it
    cat "$FI_DIR/parts/fi-$b.tar.xz.part-"* | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as t:
    t.extractall(sys.argv[1], filter="data")' "$FI_DIR" || return 1
    echo "$want" > "$FI_DIR/site/.$b.sha256"
    echo "fi-$b: unpacked"
  done
  fi_env
  (cd "$FI_ROOT" && python3 -c 'import flashinfer, hunyuan_kernels._flashinfer as f; print("flashinfer", flashinfer.__version__, "offered:", f.available())')
}

fi_save() {   # the JIT-built modules (.fi/ws/.../<name>/<name>.so) as the aot bundle, in parts under $OUT
  local out=${OUT:?save writes under \$OUT} so n aot=$FI_DIR/build/site/flashinfer/data/aot
  rm -rf "$FI_DIR/build" && mkdir -p "$aot" || return 1
  while read -r so; do
    n=$(basename "$so" .so)
    [ "$(basename "$(dirname "$so")")" = "$n" ] || continue        # a module's library, not a helper object
    mkdir -p "$aot/$n" && cp "$so" "$aot/$n/" && echo "aot: $n ($(du -h "$so" | cut -f1))"
  done < <(find "$FI_DIR/ws" -name '*.so')
  [ -n "$(ls -A "$aot")" ] || { echo "aot: no built module under .fi/ws"; return 1; }
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$FI_DIR/build" -cf - site \
    | xz -6 -T0 > "$FI_DIR/fi-aot.tar.xz" || return 1
  sha256sum "$FI_DIR/fi-aot.tar.xz" | cut -d' ' -f1 > "$out/fi-aot.sha256"
  split -b 15m "$FI_DIR/fi-aot.tar.xz" "$out/fi-aot.tar.xz.part-"     # $OUT brings back files of 16 MB at most
  rm -rf "$FI_DIR/build"
  ls -l "$out"/fi-aot.*
  echo "here: cp <files_at>/fi-aot.* .fi/parts/ (then carry .fi/parts)"
}

# The smallest call of each family that builds it (a built family loads from .fi/ws at once).
declare -A FI_CODE=(
  [norm]='from hunyuan_kernels import norm; x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16); w = torch.ones(4096, device="cuda", dtype=x.dtype); norm.rms_norm_flashinfer(x, w, 1e-5); fi.norm.fused_add_rmsnorm(x, x.clone(), w, 1e-5)'
  [topk]='from hunyuan_kernels import sampling; sampling.topk_flashinfer(torch.randn(133120, device="cuda"), 1024)'
  [decode]='from hunyuan_kernels import decode_attention as da; q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16); k = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16); da.decode_attention_flashinfer(q, k, k, torch.tensor([33], device="cuda"))'
  [sampler]='fi.sampling.top_k_top_p_sampling_from_logits(torch.randn(1, 133120, device="cuda"), 1024, 0.95)'
  # one module (fused_moe_90) holds every SM90 dtype: the bf16 call builds it, the FP8 one shows that path runs
  [moe]='E, H, I, k, n = 4, 256, 128, 2, 3; d = dict(device="cuda"); x = torch.randn(n, H, **d).bfloat16(); ids = torch.arange(k, dtype=torch.int32, **d).expand(n, k).contiguous(); p = torch.full((n, k), 0.5, **d); w1 = (torch.randn(E, 2 * I, H, **d) / 16).bfloat16(); w2 = (torch.randn(E, H, I, **d) / 11).bfloat16(); fi.cutlass_fused_moe(x, ids, p, w1, w2, torch.bfloat16, []); f8 = torch.float8_e4m3fn; one = torch.ones((), **d); fi.cutlass_fused_moe(x.to(f8), ids, p, w1.to(f8), w2.to(f8), torch.bfloat16, [one.expand(E).contiguous(), one, one.expand(E).contiguous(), one]); print("moe: bf16 and fp8 ran")'
)
FI_ALL=(norm topk decode sampler moe)

fi_start() {   # fi_start NICE FAMILY...: each family's build in its own session, logged under .fi/warm
  local nice=$1 fam; shift
  fi_env
  mkdir -p "$FI_WARM"
  for fam in "$@"; do
    [ -n "${FI_CODE[$fam]:-}" ] || { echo "unknown family $fam (known: ${FI_ALL[*]})"; return 1; }
    if [ "$(cut -d' ' -f1 "$FI_WARM/$fam.rc" 2>/dev/null)" = 0 ]; then echo "flashinfer JIT $fam: built"; continue; fi
    if fi_running "$fam"; then
      echo "flashinfer JIT $fam: already building (pid $(cat "$FI_WARM/$fam.pid"))"; continue
    fi
    rm -f "$FI_WARM/$fam.rc"
    date +%s > "$FI_WARM/$fam.start"
    rm -f "$FI_WARM/$fam.pid"
    # setsid: a session of its own, so the build outlives this call; it writes its own pid (the session's
    # leader), and the rc file when it ends
    ( cd "$FI_ROOT" || exit; setsid nohup nice -n "$nice" bash -c 'echo $$ > "$3.pid"
        s=$(date +%s); timeout "$1" python3 -c "import torch, flashinfer as fi; $2; torch.cuda.synchronize()"; r=$?
        echo "$r $(( $(date +%s) - s ))" > "$3.rc"' bash "${FI_BG_TIMEOUT:-3600}" "${FI_CODE[$fam]}" "$FI_WARM/$fam" \
        > "$FI_WARM/$fam.log" 2>&1 < /dev/null & )
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$FI_WARM/$fam.pid" ] && break; sleep 0.2; done
    echo "flashinfer JIT $fam: started (pid $(cat "$FI_WARM/$fam.pid" 2>/dev/null), MAX_JOBS=$MAX_JOBS, nice $nice," \
      "log .fi/warm/$fam.log)"
  done
}

fi_running() {   # fi_running FAMILY: started, not ended, its process alive
  [ ! -f "$FI_WARM/$1.rc" ] && kill -0 "$(cat "$FI_WARM/$1.pid" 2>/dev/null)" 2>/dev/null
}

fi_wait() {   # fi_wait SECONDS: until no family started is still building, or SECONDS pass; rc 1 unless all built
  local end=$(( $(date +%s) + ${1:-0} )) fams=() fam rc secs busy bad=0 t0=$(date +%s)
  for f in "$FI_WARM"/*.start; do [ -f "$f" ] && fams+=("$(basename "${f%.start}")"); done
  [ ${#fams[@]} -gt 0 ] || { echo "no builds started (.fi/warm/*.start absent)"; return 1; }
  while :; do
    busy=0
    for fam in "${fams[@]}"; do fi_running "$fam" && busy=1; done
    [ $busy = 0 ] || [ "$(date +%s)" -ge $end ] && break
    sleep 2
  done
  for fam in "${fams[@]}"; do
    if read -r rc secs 2>/dev/null < "$FI_WARM/$fam.rc"; then
      echo "flashinfer JIT $fam: rc=$rc in $secs s"
      [ "$rc" = 0 ] || { bad=1; tail -n 20 "$FI_WARM/$fam.log"; }
    elif fi_running "$fam"; then
      bad=1
      echo "flashinfer JIT $fam: still building after $(( $(date +%s) - $(cat "$FI_WARM/$fam.start") )) s;" \
        "log: $(tail -n 1 "$FI_WARM/$fam.log" | cut -c1-160)"
    else
      bad=1; echo "flashinfer JIT $fam: ended without an rc (killed?)"; tail -n 20 "$FI_WARM/$fam.log"
    fi
  done
  echo "flashinfer JIT: waited $(( $(date +%s) - t0 )) s"
  return $bad
}

case "${1:-}" in
  prepare) shift; fi_prepare "$@" ;;
  install) fi_install ;;
  warm) shift; [ $# -gt 0 ] || set -- norm topk decode sampler
    fi_start 0 "$@" && fi_wait "${FI_BUILD_TIMEOUT:-240}" ;;     # (what is not built by then goes on building)
  warm-bg) shift; [ $# -gt 0 ] || set -- "${FI_ALL[@]}"; fi_start "${FI_NICE:-10}" "$@" ;;
  wait) fi_wait "${2:-0}" ;;
  save) fi_save ;;
  *) echo "usage: bash bench/flashinfer_install.sh prepare [bundle...]|warm [family...]|warm-bg [family...]|wait [s]|save,"\
          "source bench/flashinfer_install.sh install"; false ;;
esac
