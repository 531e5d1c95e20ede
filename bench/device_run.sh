#!/usr/bin/env bash
# One call on the GPU machine: `bash bench/device_run.sh SECTION...`, the sections in order:
#   gpu-tests      the engine's GPU tests (CUDA graphs, plans on one GPU, quantized checkpoints end to end)
#   kernel-tests   the GPU tests of the bf16 kernels (ops, moe, GEMM1, decode attention, top-k, VAE)
#   quant-tests    the GPU tests of the quantized kernels (GEMMs, GEMVs, moe_quant)
#   kernels        suites kernels-ops, kernels-moe --quick, decode-attention, denoise-attention
#   gemms          suites gemm1, grouped-layout (the grouped MoE GEMMs' kernels and layouts)
#   quant          suites kernels-quant --quick, kernels-quant --decode, decode-parts
#   moe-decode     the batched decode MoE's GPU tests, then suite moe-decode (N = 1..32, every format)
#   moe-scaled     the batched decode MoE on tl.dot_scaled (tile key SCALED): its GPU tests, then its tile sweep
#   vae            suite convs
#   tables         suite tables --profile (every 4-GPU plan, one rank each)
#   one-gpu        suite one-gpu, every quantized build, --fp8-speedup
#   decode-profile suite one-gpu --profile-decode (where a quantized decode token goes)
#   host           suites prefill-host, train-step
#   serving        suite serving: MXFP4 Distil tp1 (7a) and a hybrid4 rank (7b), 1/4/16 clients, then the
#                  GPU test of graph keys across requests (denoise keys captured once)
#   serving-policies  issue 42's table on humming-fp8's decode (installs the carried .whl): MXFP4 Distil tp1,
#                  1/4/16 clients closed, --max-batch 16, policies interleave:8 and overlap:8, --max-denoise-batch 1
#                  then 4 (the default policy and denoise batch are chosen from it)
#   serving-default  suite serving as the server runs by default (installs the carried .whl): MXFP4 Distil tp1 on
#                  humming-fp8, the default step policy (overlap on one GPU) and lookahead, a preview every step,
#                  the warm-up first, 1/4/16 clients closed, --max-batch 16
#   serving-ab     issue 42's same-kernels A/B (carry .ab/c6abc07: `git archive c6abc07` without assets, tests,
#                  train, docs): c6abc07's scheduler, then today's (its defaults), both on triton's kernels, 1/4/16
#                  clients, --max-batch 16
#   lanes-ab       overlap's lanes in three trees (carry .ab/cafb557 and .ab/f93900b: git archive without assets,
#                  tests, train, docs): cafb557 (one priority, a merge after each hand-off and VAE decode), f93900b
#                  (the AR lane at the highest priority), today's (and no merge after own work: slots drain);
#                  humming-fp8 (installs the carried .whl), overlap:8, $CLIENTS clients (default 16), closed
#   humming-tune   suite humming-tune (installs the carried .whl): humming's indexed GEMM configs (N tile, CTAs an SM)
#                  around its heuristics' pick at 1 and 2 rows, W4A8, 8 layers a graph: faster, same bits?
#   lookahead      suite serving on humming-fp8 (installs the carried .whl): MXFP4 Distil tp1, 1 and 16 clients closed,
#                  --max-batch 16, the decode steps launched ahead off then on (scheduler.py 3.)
#   mxfp8-fold     `--mxfp8-kernels fp8` (installs the carried .whl): suite one-gpu, MXFP4 Distil on humming
#                  (W4A16: the velocity reference) and humming-fp8 (W4A8, auto's choice), each with its MXFP8 linears
#                  triton vs fp8 (--profile-step: no dequantize pass left; each row's step velocity vs the first's)
#   mxfp8-fold-more  the MXFP8 build triton vs fp8 (its experts folded too: the FP8 grouped path), then where a
#                  decode token goes on humming-fp8 + fp8 (--profile-decode)
#   pdl            suite pdl: programmatic dependent launch on a chain of 64 FP8 GEMVs (compiles? captures? us saved)
#   serving-profile  suite serving --profile: MXFP4 Distil tp1, 16 clients, --max-batch 8 then 16 (each step
#                  synchronized and its wall time summed by what it held: decode rows, denoise rows, slots)
#   sampling-rows  the GPU tests of batched sampling (triton_rows, the CUDA default of sample_rows: every row's
#                  token equals the one-row op's), of top-k and the sample kernels, then decode-parts --sections rows
#   determinism    suite determinism: the tiny checkpoint's bf16 request 4 times (eager, then graphs on), the
#                  embedded model's as the control: the first module whose output differs, PyTorch's flagged ops
#   moe-tune-decode  suite moe-decode --tune-decode: the GEMV decode MoE's tile configs at N = 1, 8, 16 (MXFP4, 8
#                  layers a graph), each checked (reference, batch invariance) and timed
#   warmup         the GPU test of the warm-up, then suite serving --warmup (MXFP4 Distil tp1, 1 and 4 clients): the
#                  warm-up's seconds and graphs, and what the first request still captured
#   denoise-batch  the GPU test of denoise steps batched across requests, then suite serving (MXFP4 Distil tp1,
#                  16 clients) once per --max-denoise-batch in $DENOISE_BATCHES (default "1 2 4", one command each)
#   studio         suite studio on CUDA
#   replicas       suite replicas on CUDA: 8 clients, one engine vs two Ray Serve replicas on the one GPU
#   replicas-autoscale  suite replicas-autoscale on CUDA: the autoscaler takes 1 -> 2 replicas on the one GPU
#                  under 6 clients, and back to 1 once they stop
#                  (both first install the carried Ray Serve bundle, bench/replicas_install.sh: carry
#                  .rw/parts/rw-site.manifest and the parts, one a call on the warm machine, as prepare prints)
#   eval           the embedded model's accuracy on CUDA (train.evaluate, seed 2, 100 + 100)
#   humming        installs the carried humming-kernels wheel (.whl), its GPU tests, suite humming, then suite one-gpu
#                  (MXFP4 Distil) with --moe-kernels humming-fp8,humming,triton --profile-step
#   flashinfer     installs the carried FlashInfer (bench/flashinfer_install.sh: carry .fi/parts), waits up to
#                  FI_WAIT (60) s for the JIT builds flashinfer-bg started (else builds its four families, 240 s),
#                  its variants' GPU tests (failing, not skipping, where it does not import), suite flashinfer
#                  (ours vs FlashInfer per op; the MoE rows where its fused MoE is built)
#   flashinfer-bg  installs it and starts the JIT builds of all five families (the fused MoE: 9+ min) in the
#                  background, at nice 10; they go on after the call (run flashinfer in a later call). On
#                  2026-12-02 the top-k and fused-MoE builds were still going after 16 min: once built, save them
#   flashinfer-save  the built modules as the aot bundle's parts under $OUT (copy them into .fi/parts here:
#                  later calls and sessions carry them and load the modules without building)
#   lora           the LoRA GPU tests (graph steps per LoRA mode; no adapter and two adapters in one decode and
#                  one denoise batch; an MLP adapter among them; the moe_lora op in bf16 and as a graph), then
#                  suite lora (a hybrid4 rank's DiT step: rank-32 adapter unmerged, one slot and per row (the
#                  batched path), vs none vs merged weights, and an MLP adapter; the decode step per mode)
#   prefix-cache   the prefix cache's GPU test (cache on vs off, bf16, graphs on; tiny and embedded), then suite
#                  conversation (each turn's AR prefill with the cache off and on; embedded, a hybrid4 rank)
#   conversation   suite conversation (a 3-turn edit per history policy: tokens, prefill ms; embedded model
#                  and one hybrid4 rank at the real shapes), then the chained-edit evaluation of the policies
#   step-cache     the step cache's GPU tests, then suite step-cache: speed (hybrid4 rank, MXFP4 Distil) and
#                  quality (the embedded model), each to its own folder under $OUT
# Each run's log goes to $OUT/<run>.log, each suite's JSON and tables to $OUT/<suite>.json / .txt; the
# tail of each log is printed as it ends. A suite name alone (`bash bench/device_run.sh convs`) runs it.
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
tests() {   # tests NAME TIMEOUT FILE...
  local name=$1 t=$2; shift 2
  run "$name" "$t" python3 -m pytest -q -m gpu -p no:cacheprovider "$@"
}
suite() {   # suite NAME TIMEOUT SUITE [OPTIONS...]
  local name=$1 t=$2; shift 2
  run "$name" "$t" python3 -m bench "$@" --out "$OUT"
}
for section in "$@"; do
  case $section in
    gpu-tests)
      tests gpu_tests 330 -s tests/test_gpu.py ;;
    kernel-tests)
      tests kernel_tests 400 tests/test_kernels_ops.py tests/test_kernels_moe.py tests/test_kernels_moe_gemm1.py \
        tests/test_kernels_decode_attention.py tests/test_kernels_sampling_topk.py tests/test_kernels_vae.py ;;
    quant-tests)
      tests quant_tests 400 tests/test_kernels_quant.py tests/test_kernels_gemv.py tests/test_quant_resident.py ;;
    kernels)
      suite kernels_ops 100 kernels-ops
      suite kernels_moe 200 kernels-moe --quick
      suite decode_attention 120 decode-attention
      suite denoise_attention 120 denoise-attention ;;
    gemms)
      suite gemm1 240 gemm1
      suite grouped_layout 120 grouped-layout ;;
    quant)
      suite kernels_quant 240 kernels-quant --quick
      suite kernels_quant_decode 240 kernels-quant --decode
      suite decode_parts 120 decode-parts --sections sample,topk,moe ;;
    moe-decode)
      tests moe_decode_tests 400 tests/test_kernels_moe_decode.py
      suite moe_decode 590 moe-decode ;;
    moe-scaled)
      tests moe_scaled_tests 200 tests/test_kernels_moe_decode.py -k dot_scaled
      suite moe_scaled 400 moe-decode --quick --formats mxfp4,mxfp8 --ns 1,16,32 --tune-scaled ;;
    vae)
      suite convs 200 convs ;;
    tables)
      suite tables 330 tables --profile ;;
    one-gpu)
      suite one_gpu 330 one-gpu --builds mxfp4-distil,fp8-instruct,mxfp8-distil,nvfp4-distil --fp8-speedup ;;
    decode-profile)
      mkdir -p "$OUT/decode-profile"
      run decode_profile 300 python3 -m bench one-gpu --builds mxfp4-distil,mxfp8-distil,nvfp4-distil --profile-decode \
        --out "$OUT/decode-profile" ;;
    host)
      suite prefill_host 120 prefill-host
      suite train_step 240 train-step ;;
    serving)
      mkdir -p "$OUT/serving-distil" "$OUT/serving-hybrid4"
      run serving_distil 590 python3 -m bench serving --builds mxfp4-distil --per-client 1 --out "$OUT/serving-distil"
      run serving_hybrid4 590 python3 -m bench serving --builds hybrid4 --per-client 1 --out "$OUT/serving-hybrid4"
      tests serving_graph_tests 300 -s tests/test_gpu.py -k "graph_keys_captured_once or decode_graph_captured_once" ;;
    serving-policies)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/serving-policies"
      run serving_policies 590 python3 -m bench serving --builds mxfp4-distil --clients 1,4,16 --per-client 1 \
        --max-batch 16 --arrivals closed --moe-kernels humming-fp8 --mxfp8-kernels fp8 \
        --policy interleave:8,overlap:8 \
        --max-denoise-batch 1,4 --out "$OUT/serving-policies" ;;
    serving-default)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/serving-default"
      run serving_default 560 python3 -m bench serving --builds mxfp4-distil --clients 1,4,16 --per-client 1 \
        --max-batch 16 --arrivals closed --moe-kernels humming-fp8 --warmup --previews 1 --out "$OUT/serving-default" ;;
    serving-ab)
      mkdir -p "$OUT/serving-ab-old" "$OUT/serving-ab-new"
      rm -rf /tmp/old && cp -r .ab/c6abc07 /tmp/old && ln -s "$PWD/assets" /tmp/old/assets
      (cd /tmp/old && run serving_ab_old 280 python3 -m bench serving --builds mxfp4-distil --clients 1,4,16 \
        --per-client 1 --max-batch 16 --out "$OUT/serving-ab-old")
      run serving_ab_new 280 python3 -m bench serving --builds mxfp4-distil --clients 1,4,16 --per-client 1 \
        --max-batch 16 --arrivals closed --moe-kernels triton --out "$OUT/serving-ab-new" ;;
    lanes-ab)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      P="--builds mxfp4-distil --clients ${CLIENTS:-16} --per-client 1 --max-batch 16 --arrivals closed --moe-kernels humming-fp8 --policy overlap:8"
      for c in cafb557 f93900b; do
        mkdir -p "$OUT/lanes-$c"
        rm -rf /tmp/$c && cp -r .ab/$c /tmp/$c && ln -s "$PWD/assets" /tmp/$c/assets
        (cd /tmp/$c && run lanes_$c 190 python3 -m bench serving $P --out "$OUT/lanes-$c")
      done
      mkdir -p "$OUT/lanes-head"
      run lanes_head 190 python3 -m bench serving $P --out "$OUT/lanes-head" ;;
    humming-tune)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/humming-tune"
      run humming_tune 500 python3 -m bench humming-tune --ns 1,2 --out "$OUT/humming-tune" ;;
    lookahead)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/lookahead"
      run serving_lookahead 420 python3 -m bench serving --builds mxfp4-distil --clients 1,16 --per-client 1 \
        --max-batch 16 --arrivals closed --moe-kernels humming-fp8 --lookahead off,on --out "$OUT/lookahead" ;;
    mxfp8-fold)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/mxfp8-fold"
      run one_gpu_fold 560 python3 -m bench one-gpu --builds mxfp4-distil --moe-kernels humming,humming-fp8 \
        --mxfp8-kernels triton,fp8 --profile-step --out "$OUT/mxfp8-fold" ;;
    mxfp8-fold-more)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p "$OUT/mxfp8-fold-mxfp8" "$OUT/decode-profile-fp8"
      run one_gpu_fold_mxfp8 300 python3 -m bench one-gpu --builds mxfp8-distil --mxfp8-kernels triton,fp8 \
        --out "$OUT/mxfp8-fold-mxfp8"
      run decode_profile_fp8 250 python3 -m bench one-gpu --builds mxfp4-distil --moe-kernels humming-fp8 \
        --mxfp8-kernels fp8 --profile-decode --out "$OUT/decode-profile-fp8" ;;
    pdl)
      suite pdl 120 pdl ;;
    serving-profile)
      for mb in 8 16; do
        mkdir -p "$OUT/serving-profile-mb$mb"
        run serving_profile_mb$mb 590 python3 -m bench serving --builds mxfp4-distil --clients 16 --per-client 1 \
          --max-batch "$mb" --profile --out "$OUT/serving-profile-mb$mb"
      done ;;
    sampling-rows)
      tests sampling_rows_tests 400 tests/test_sampling_rows.py tests/test_kernels_sampling_topk.py tests/test_kernels_ops.py
      mkdir -p "$OUT/decode-parts-rows"
      run decode_parts_rows 300 python3 -m bench decode-parts --sections rows --out "$OUT/decode-parts-rows" ;;
    determinism)
      for m in "tiny" "tiny --graphs" "tiny --ar" "embedded"; do
        name=$(echo "$m" | tr -d ' -'); mkdir -p "$OUT/determinism-$name"
        # shellcheck disable=SC2086
        run "determinism_$name" 200 python3 -m bench determinism --model $m --out "$OUT/determinism-$name"
      done ;;
    moe-tune-decode)
      mkdir -p "$OUT/moe-tune-decode"
      run moe_tune_decode 590 python3 -m bench moe-decode --quick --formats mxfp4 --ns 1,8,16 --variants decode \
        --tune-decode --out "$OUT/moe-tune-decode" ;;
    warmup)
      tests warmup_tests 300 -s tests/test_gpu.py -k warmup
      mkdir -p "$OUT/serving-warmup"
      run serving_warmup 590 python3 -m bench serving --builds mxfp4-distil --clients 1,4 --per-client 1 --warmup \
        --out "$OUT/serving-warmup" ;;
    denoise-batch)
      tests denoise_batch_tests 300 -s tests/test_gpu.py -k "denoise_batch or graph_keys_captured_once"
      for b in ${DENOISE_BATCHES:-1 2 4}; do
        mkdir -p "$OUT/serving-dbatch$b"
        run serving_dbatch$b 590 python3 -m bench serving --builds mxfp4-distil --clients 16 --per-client 1 \
          --max-denoise-batch "$b" --out "$OUT/serving-dbatch$b"
      done ;;
    studio)
      suite studio 300 studio --app-args="--device cuda" ;;
    replicas)     # ray[serve] from the carried bundle: one engine vs two replicas sharing the GPU
      if source bench/replicas_install.sh install; then
        suite replicas 590 replicas --app-args="--device cuda" --gpus-per-replica 0.5 --clients 8 --requests 32
      else
        echo "=== replicas: Ray Serve not installed (carry .rw/parts: bash bench/replicas_install.sh prepare)"
      fi ;;
    replicas-autoscale)   # Ray Serve's autoscaler, 1 -> 2 replicas sharing the GPU -> 1, as /health reports it
      if source bench/replicas_install.sh install; then
        suite replicas_autoscale 590 replicas-autoscale --app-args="--device cuda --gpus-per-replica 0.5"
      else
        echo "=== replicas-autoscale: Ray Serve not installed (carry .rw/parts: bash bench/replicas_install.sh prepare)"
      fi ;;
    eval)
      run eval_cuda 330 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 \
        --n 100 --n-edit 100 --seed 2 --device cuda --json "$OUT/eval_cuda.json" ;;
    humming)
      # humming-kernels from the carried wheel (here: pip download --no-deps humming-kernels==0.1.19 -d .whl; carry .whl)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/humming_kernels-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      tests humming_tests 300 tests/test_humming.py
      suite humming 330 humming
      suite one_gpu_humming 590 one-gpu --builds mxfp4-distil --moe-kernels humming-fp8,humming,triton --profile-step ;;
    flashinfer)
      if source bench/flashinfer_install.sh install; then
        if [ -d .fi/warm ]; then bash bench/flashinfer_install.sh wait "${FI_WAIT:-60}"; else bash bench/flashinfer_install.sh warm; fi
        export HUNYUAN_REQUIRE_FLASHINFER=1
        tests flashinfer_tests 180 tests/test_kernels_flashinfer.py
        suite flashinfer 330 flashinfer
      else
        echo "=== flashinfer: not installed (carry .fi/parts: bench/flashinfer_install.sh)"
      fi ;;
    flashinfer-bg)
      if source bench/flashinfer_install.sh install; then
        bash bench/flashinfer_install.sh warm-bg
      else
        echo "=== flashinfer-bg: not installed (carry .fi/parts: bench/flashinfer_install.sh)"
      fi ;;
    flashinfer-save)
      bash bench/flashinfer_install.sh wait 0; bash bench/flashinfer_install.sh save ;;
    lora)
      tests lora_tests 300 -s tests/test_lora.py tests/test_kernels_moe_lora.py -k "cuda or gpu"
      run lora 590 python3 -m bench lora ;;
    step-cache)
      tests step_cache_tests 300 -s tests/test_step_cache.py
      run step_cache_speed 590 python3 -m bench step-cache --speed --out "$OUT/step-cache-speed"
      run step_cache_quality 400 python3 -m bench step-cache --quality --out "$OUT/step-cache-quality" ;;
    prefix-cache)
      tests prefix_cache_tests 300 -s tests/test_prefix_cache.py
      suite conversation 400 conversation ;;
    conversation)
      suite conversation 400 conversation
      run eval_chains 590 python3 -m train.evaluate --model assets/model --modes think_recaption --example-seeds 0 \
        --n 0 --chains 40 --seed 2 --device cuda --json "$OUT/eval_chains.json" ;;
    *)
      if python3 -c "import sys; from bench.suites import SUITES; sys.exit(sys.argv[1] not in SUITES)" "$section"; then
        suite "${section//-/_}" 590 "$section"
      else
        echo "unknown section $section"
      fi ;;
  esac
done
