#!/usr/bin/env bash
# FlashInfer 0.7.4 for the GPU machine, which reaches no package index and takes at most 64 MiB a call with
# the working tree (~29 MiB) included, while FlashInfer's wheel alone is 97 MiB.
#
#   bash bench/flashinfer_install.sh prepare     # here (pip, xz; ~10 min of xz on 2 busy cores): writes
#                                                # .fi/parts/fi-site.tar.xz.part-* and .fi/parts/fi-site.sha256
#   source bench/flashinfer_install.sh install   # there: unpacks the parts into .fi/site once, exports the
#                                                # environment (PYTHONPATH, the JIT cache under .fi/ws)
#   bash bench/flashinfer_install.sh warm        # there, after install: JIT-builds the four kernel families
#                                                # our ops and the bench use, in parallel, timed
#
# prepare downloads, without their dependencies, flashinfer-python 0.7.4 and what it imports that the GPU
# image lacks: apache-tvm-ffi, cuda-tile, nccl4py (the image has torch, numpy, ninja, einops, click, tabulate,
# tqdm, requests, nvidia-ml-py, cuda-bindings). Left out: nccl-extensions (23 MB) and nvidia-cudnn-frontend
# (12 MB); FlashInfer imports `nccl.ep` only inside its expert-parallel MoE and `cudnn` under try/except.
# It unpacks the wheels as `pip install --no-deps --target` would (a wheel is a zip of the installed files),
# leaving out of FlashInfer's the kernel sources no build of ours reads: the subfolders of flashinfer/data/csrc
# (other families: cake_*, fused_moe, kda, ...) and the .cu/.cuh files outside flashinfer/data. Kept: every
# Python file, flashinfer/data/{include,cutlass,cccl,spdlog} and csrc's own files (the norm, sampling, top-k
# and batch-decode sources with their bindings and templates). xz takes the 205 MB to ~25 MB: one part, so
# one call carries it (PART_MB splits it for more calls). The CUTLASS fused MoE needs csrc/fused_moe: not here.
#
# On the GPU machine each call runs in a fresh copy of the tree, but ignored paths already there stay while
# the machine is warm: .fi/site and the JIT cache .fi/ws survive between warm calls; carry only .fi/parts.
FI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FI_DIR=$FI_ROOT/.fi
FI_WHEELS=(flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 nccl4py==0.6.0)

fi_prepare() {
  local py=${PYTHON:-python3}
  mkdir -p "$FI_DIR/wheels" && rm -rf "$FI_DIR/build" "$FI_DIR/parts" && mkdir -p "$FI_DIR/build/site" "$FI_DIR/parts" || return 1
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$FI_DIR/wheels" "${FI_WHEELS[@]}" || return 1
  "$py" - "$FI_DIR" <<'EOF' || return 1
import pathlib, sys, zipfile
fi = pathlib.Path(sys.argv[1])
names = ("flashinfer_python-0.7.4-", "apache_tvm_ffi-0.1.15.post2-", "cuda_tile-1.7.0-", "nccl4py-0.6.0-")
for prefix in names:
    (wheel,) = fi.glob(f"wheels/{prefix}*.whl")
    z = zipfile.ZipFile(wheel)
    def kept(n: str) -> bool:
        if n.startswith("flashinfer/data/csrc/"):
            return "/" not in n[len("flashinfer/data/csrc/"):]
        return n.startswith("flashinfer/data/") or not n.endswith((".cu", ".cuh"))
    keep = [n for n in z.namelist() if kept(n)]
    z.extractall(fi / "build" / "site", keep)
    print(f"{wheel.name}: {len(keep)} of {len(z.namelist())} files")
EOF
  tar -C "$FI_DIR/build" -cf - site | xz -6 -T2 > "$FI_DIR/fi-site.tar.xz" || return 1
  sha256sum "$FI_DIR/fi-site.tar.xz" | cut -d' ' -f1 > "$FI_DIR/parts/fi-site.sha256"
  split -b "${PART_MB:-33}m" "$FI_DIR/fi-site.tar.xz" "$FI_DIR/parts/fi-site.tar.xz.part-"
  rm -rf "$FI_DIR/build"
  ls -l "$FI_DIR/parts"
  echo "carry: .fi/parts (one part), or per call .fi/parts/fi-site.sha256 and one part each"
}

fi_install() {
  local want got
  want=$(cat "$FI_DIR/parts/fi-site.sha256" 2>/dev/null) || { echo "no .fi/parts/fi-site.sha256: carry .fi/parts"; return 1; }
  if [ "$(cat "$FI_DIR/site/.sha256" 2>/dev/null)" != "$want" ]; then
    got=$(cat "$FI_DIR"/parts/fi-site.tar.xz.part-* | sha256sum | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
      echo "the parts under .fi/parts do not make fi-site.tar.xz (one missing?):"; ls -l "$FI_DIR/parts"; return 1
    fi
    rm -rf "$FI_DIR/site"
    cat "$FI_DIR"/parts/fi-site.tar.xz.part-* | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as t:
    t.extractall(sys.argv[1], filter="data")' "$FI_DIR" || return 1
    echo "$want" > "$FI_DIR/site/.sha256"
  fi
  # FLASHINFER_USE_CUDA_NORM: its CUDA norm kernels (the CuTe DSL ones need nvidia-cutlass-dsl, not carried)
  export PYTHONPATH=$FI_DIR/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=$FI_DIR/ws \
    FLASHINFER_USE_CUDA_NORM=1 MAX_JOBS=${MAX_JOBS:-16}
  mkdir -p "$FI_DIR/ws"
  (cd "$FI_ROOT" && python3 -c 'import flashinfer, kernels._flashinfer as f; print("flashinfer", flashinfer.__version__, "offered:", f.available())')
}

fi_warm() {   # the JIT builds, one process a family, in parallel (a built family loads from .fi/ws at once)
  local t0 fam pids=() rc=0
  t0=$(date +%s)
  declare -A code=(
    [norm]='from kernels import norm; x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16); w = torch.ones(4096, device="cuda", dtype=x.dtype); norm.rms_norm_flashinfer(x, w, 1e-5); fi.norm.fused_add_rmsnorm(x, x.clone(), w, 1e-5)'
    [topk]='from kernels import sampling; sampling.topk_flashinfer(torch.randn(133120, device="cuda"), 1024)'
    [decode]='from kernels import decode_attention as da; q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16); k = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16); da.decode_attention_flashinfer(q, k, k, torch.tensor([33], device="cuda"))'
    [sampler]='fi.sampling.top_k_top_p_sampling_from_logits(torch.randn(1, 133120, device="cuda"), 1024, 0.95)'
  )
  for fam in norm topk decode sampler; do
    ( cd "$FI_ROOT" && s=$(date +%s) && timeout "${FI_BUILD_TIMEOUT:-240}" python3 -c "import torch, flashinfer as fi; ${code[$fam]}; torch.cuda.synchronize()" \
        > "/tmp/fi_build_$fam.log" 2>&1; r=$?; echo "flashinfer JIT $fam: rc=$r in $(( $(date +%s) - s )) s"; exit $r ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "flashinfer JIT, all families: $(( $(date +%s) - t0 )) s"
  [ $rc = 0 ] || tail -n 20 /tmp/fi_build_*.log     # (not under $OUT: a call brings back 8 files)
  return $rc
}

case "${1:-}" in
  prepare) fi_prepare ;;
  install) fi_install ;;
  warm) fi_warm ;;
  *) echo "usage: bash bench/flashinfer_install.sh prepare|warm, source bench/flashinfer_install.sh install"; false ;;
esac
