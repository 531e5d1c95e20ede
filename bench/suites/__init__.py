"""The suites of `python -m bench`, by name. Each module has a docstring (its --help), `DRY` (whether it
has a --dry path: CPU, Triton's interpreter or the reference ops, tiny shapes), `CUDA = False` where it
runs without a GPU as it is, `add_arguments(parser)` and `run(args, out) -> bool` (False: a check failed)."""
from __future__ import annotations

SUITES = {
    "tables": "the seed article's tables for one rank of each 4-GPU plan at the real shapes (compute only)",
    "one-gpu": "the quantized builds on one GPU at the real shapes: memory, prefill, decode, DiT step, a whole request",
    "kernels-ops": "the small fused ops (norms, RoPE, sampling) against their references",
    "kernels-moe": "the `moe` op's variants at one rank's real shapes (decode, denoise, the two-dispatch ablation)",
    "kernels-quant": "the quantized GEMMs and the `moe_quant` op at the real shapes (--decode: the decode GEMVs)",
    "moe-decode": "the quantized decode MoE of a batched decode step (N = 1..32) against the touched-experts floor",
    "humming": "the MXFP4 MoE layer on humming-kernels (W4A16 / W4A8, packs laid out at load) beside ours, decode and denoise",
    "humming-tune": "humming's indexed GEMM tile configs around its heuristics' pick at a decode step's rows",
    "folds": "what folding a checkpoint's MX block scales (FP8 per channel, humming's W4A8) rounds, per kind of linear",
    "decode-attention": "the decode step's attention op against masked and sliced SDPA",
    "denoise-attention": "the denoise step's SDPA forms and the Ulysses layout copies at a hybrid4 rank's shapes",
    "convs": "the image heads' and the VAE decoder's convolutions, GroupNorm + swish, the whole VAE decode",
    "gemm1": "the grouped MoE path's GEMM1 + SwiGLU: the fused kernel's tile variants against the grouped one",
    "grouped-layout": "the resident expert packs' grouped GEMMs: one down GEMM over the micros vs one per micro",
    "flashinfer": "FlashInfer's norms, top-k, sampler and decode attention beside ours at the engine's shapes",
    "decode-parts": "the rest of a quantized decode token: the sampler, its top-k, one MoE decode layer",
    "pdl": "programmatic dependent launch on a chain of decode-like GEMVs: does it work and capture, us a kernel saved",
    "prefill-host": "the host time of the eager T2I prefill of one hybrid4 rank, stage by stage",
    "serving": "whole requests through the engine's scheduler at 1, 4, 16 clients: images/min, p50/p90 latency",
    "studio": "the wall time of studio requests end to end through the web server",
    "page": "one request through the page in a real browser against the same request through /v1 (same server)",
    "soak": "minutes of mixed /v1 load on app.py with faults injected (kill, stop, disconnects, large bodies): "
            "nothing lost, hung or leaked",
    "replicas": "throughput of engine replicas on Ray Serve against one engine, at K concurrent /v1 clients",
    "replicas-autoscale": "Ray Serve's autoscaler on the replicas, live: 1 -> 2 under queue depth and back, per /health",
    "train-step": "where a training step of the embedded model goes",
    "lora": "LoRA adapters: a hybrid4 rank's DiT and decode step, unmerged (one slot, per row) vs none vs merged",
    "step-cache": "the step cache's settings: denoise time per image at the real shapes, image PSNR/SSIM vs no cache",
    "determinism": "the same request run several times: the first module whose output differs between runs",
    "conversation": "a 3-turn edit conversation per history policy: each turn's tokens and prefill ms (embedded, real shapes)",
    "history-memory": "a chat body of 8 turns x 4 history images of 4096x4096, prepared N times: the server's RSS",
}


def module_name(suite: str) -> str:
    return "bench.suites." + suite.replace("-", "_")
