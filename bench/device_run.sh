#!/usr/bin/env bash
# One call on the GPU machine: `bash bench/device_run.sh SECTION...` (kernels, vae, engine, quant, verify, final, decodeprof, onegpu, tables, eval, dattn, evalsep, evals4, w2, w2b, pf, g1, g2).
# Each section's log goes to $OUT/<section>.log; a short summary is printed last.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
run() {   # run NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n 25 "$OUT/$name.log"
}
for section in "$@"; do
  case $section in
    kernels)
      run kernel_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_ops.py tests/test_kernels_moe.py
      run bench_ops 100 python3 bench/bench_kernels_ops.py
      run bench_moe 200 python3 bench/bench_kernels_moe.py --quick ;;
    vae)
      run vae_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_kernels_vae.py
      run bench_convs 200 python3 bench/bench_convs.py ;;
    engine)
      run gpu_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_gpu.py ;;
    tables)
      run seed_tables 330 python3 bench/bench_seed_tables.py --profile ;;
    quant)
      run quant_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_quant.py tests/test_kernels_gemv.py tests/test_quant_resident.py
      run bench_decode 240 python3 bench/bench_kernels_quant.py --decode ;;
    verify)
      run verify_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_attention.py tests/test_kernels_moe.py tests/test_quant_resident.py tests/test_gpu.py
      run verify_quant 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py tests/test_kernels_quant.py -k "decode or graph"
      run bench_dattn 120 python3 bench/bench_decode_attention.py ;;
    final)
      run final_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_sampling_topk.py tests/test_kernels_ops.py tests/test_kernels_moe.py tests/test_gpu.py
      run final_quant 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py tests/test_kernels_quant.py tests/test_quant_resident.py -k "decode or graph or resident"
      run decode_parts 60 python3 bench/bench_decode_parts.py --sections topk,sample
      run one_gpu 200 python3 bench/bench_one_gpu.py --builds mxfp4-distil,fp8-instruct,mxfp8-distil,nvfp4-distil --fp8-speedup
      run seed_tables 120 python3 bench/bench_seed_tables.py --profile ;;
    decodeprof)
      run one_gpu_prof 300 python3 bench/bench_one_gpu.py --builds mxfp4-distil,mxfp8-distil,nvfp4-distil --profile-decode
      run grouped_layout 90 python3 bench/bench_grouped_layout.py ;;
    onegpu)
      run one_gpu 330 python3 bench/bench_one_gpu.py --fp8-speedup ;;
    eval)
      run eval_cuda 240 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 --n 40 --n-edit 40 --device cuda --json "$OUT/eval_cuda.json" ;;
    dattn)
      run denoise_attention 120 python3 bench/bench_denoise_attention.py ;;
    evalsep)   # CUDA vs CPU on the edits: the reference ops on CUDA (seed 2), the fast paths on a second sample (seed 3)
      run eval_cuda_torch 240 env HUNYUAN_KERNELS=torch python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 --n 10 --n-edit 100 --seed 2 --device cuda --json "$OUT/eval_cuda_torch.json"
      run eval_cuda_s3 200 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 --n 20 --n-edit 200 --seed 3 --device cuda --json "$OUT/eval_cuda_s3.json" ;;
    evals4)    # a third sample of the edits (300), on CUDA with the fast paths
      run eval_cuda_s4 240 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 --n 10 --n-edit 300 --seed 4 --device cuda --json "$OUT/eval_cuda_s4.json" ;;
    w2)        # the cols-packed expert down pack: its GPU tests, the layout bench, one hybrid4 rank's tables
      run w2_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py tests/test_kernels_quant.py tests/test_kernels_gemv.py
      run grouped_layout 90 python3 bench/bench_grouped_layout.py
      run seed_hybrid4 150 python3 bench/bench_seed_tables.py --plans hybrid4 --profile ;;
    w2b)       # the engine's GPU tests, the one-GPU quantized builds, every plan's tables, a third edit sample
      run w2b_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_quant_resident.py tests/test_kernels_decode_attention.py tests/test_kernels_sampling_topk.py tests/test_kernels_ops.py
      run one_gpu 200 python3 bench/bench_one_gpu.py --builds mxfp4-distil,fp8-instruct,mxfp8-distil,nvfp4-distil --fp8-speedup
      run seed_tables 150 python3 bench/bench_seed_tables.py ;;
    pf)        # the prefill graphs: the engine's GPU tests, then hybrid4's tables with the profile
      run pf_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_kernels_moe.py
      run seed_hybrid4 150 python3 bench/bench_seed_tables.py --plans hybrid4 --profile ;;
    g1)        # the fused GEMM1 default and the Ulysses send layout: their GPU tests, the GEMM1 bench, every plan's tables
      run g1_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe_gemm1.py tests/test_kernels_moe.py tests/test_kernels_ops.py tests/test_gpu.py
      run bench_gemm1 120 python3 bench/bench_gemm1.py
      run seed_tables 240 python3 bench/bench_seed_tables.py --profile ;;
    g2)        # hybrid4's tables, the quantized builds' requests, an edit sample (the fused down GEMM this section also ran is gone: ce54bed^2)
      run seed_hybrid4 90 python3 bench/bench_seed_tables.py --plans hybrid4
      run quant_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_resident.py
      run eval_cuda_s2 150 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 --n 10 --n-edit 100 --seed 2 --device cuda --json "$OUT/eval_cuda_s2.json" ;;
    *) echo "unknown section $section" ;;
  esac
done
