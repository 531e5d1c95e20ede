"""GPU checks (run on the GPU machine: `python -m pytest -m gpu tests/test_gpu.py`)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

import kernels
from engine.runtime.events import Error, Image, Text
from engine.model.loader import load
from engine.model.moe import MoE
from engine.parallel.layout import PhaseView
from engine.runtime.pipeline import Pipeline
from engine.runtime.request import Request
from engine.serve.server import EngineServer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REQ = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=3, seed=3, greedy=True)


def outcome(events):
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in events if isinstance(e, Image))
    return ("".join(e.delta for e in events if isinstance(e, Text)),
            np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64), events[-1].timings)


def psnr(a, b):
    return 10 * np.log10(255 ** 2 / max(((a - b) ** 2).mean(), 1e-12))


@pytest.fixture(scope="module")
def cuda_fp32(tiny_dir):
    return outcome(list(Pipeline(load(tiny_dir, "cuda", torch.float32), preview_every=0).run(Request(**REQ))))


def test_cuda_fp32_text_equals_cpu(tiny, cuda_fp32):
    cpu = outcome(list(Pipeline(tiny, preview_every=0).run(Request(**REQ))))
    assert cuda_fp32[0] == cpu[0]


def test_bf16_close_to_fp32(tiny_dir, cuda_fp32):
    bf = outcome(list(Pipeline(load(tiny_dir, "cuda", torch.bfloat16), preview_every=0).run(Request(**REQ))))
    print(f"bf16 vs fp32 PSNR {psnr(bf[1], cuda_fp32[1]):.1f} dB, same text: {bf[0] == cuda_fp32[0]}")
    assert psnr(bf[1], cuda_fp32[1]) >= 20


@torch.no_grad()      # as the engine runs; under autograd `kernels.call` runs the reference (no backward)
def test_grouped_moe_bf16_matches_fp32():
    torch.manual_seed(0)
    m = MoE(512, 16, 4, 256, 256, True, micros=2, storage_size=1, dtype=torch.float32, device="cuda")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(300, 512, device="cuda")
    ref = m(x, PhaseView(0, 2))
    mb = MoE(512, 16, 4, 256, 256, True, micros=2, storage_size=1, dtype=torch.bfloat16, device="cuda")
    mb.load_state_dict({k: v.to(v.dtype if k == "gate" else torch.bfloat16) for k, v in m.state_dict().items()})
    out = mb(x.bfloat16(), PhaseView(0, 2)).float()
    assert (out - ref).norm() / ref.norm() < 0.02
    # the AR view of the second micro: one down GEMM on the strided column block of w2 [E, H, 2 * I_micro]
    ref1 = m(x, PhaseView(1, 1))
    out1 = mb(x.bfloat16(), PhaseView(1, 1)).float()
    assert (out1 - ref1).norm() / ref1.norm() < 0.02
    assert kernels.chosen("moe") == "fused"          # bf16 ran the fast path (300 tokens: the grouped path, GEMM1 fused)


# With a GPU per rank (tp2 on a 2-GPU machine, every plan on 4) the ranks talk NCCL; with fewer GPUs
# they share GPU 0 over gloo, CUDA tensors all the same.
@pytest.mark.parametrize("plan,sp", [("tp2", None), ("hybrid4", "ulysses"), ("tp2cfg2", None),
                                     ("tp2sp2", "kv_gather")])
def test_plans_on_cuda_equal_world1(tiny_dir, cuda_fp32, plan, sp):
    with EngineServer(tiny_dir, device="cuda", dtype="float32", plan=plan, sp_kind=sp, preview_every=0) as server:
        assert server.wait_ready(300), server.health()
        res = outcome(list(server.stream(Request(**REQ))))
        stats = server.health()["ranks"]
    assert res[0] == cuda_fp32[0]
    assert psnr(res[1], cuda_fp32[1]) >= 40
    own_gpus = torch.cuda.device_count() >= len(stats)
    for s in stats:
        assert s["pointers_unchanged"]
        assert s["backend"] == ("nccl" if own_gpus else "gloo"), s
        print(f"{plan} rank {s['rank']} on {s['device']} ({s['backend']}): peak GPU memory "
              f"{s['peak_gpu_bytes'] / 2**20:.1f} MiB, resident {s['resident_bytes'] / 2**20:.1f} MiB")


def _run_text(lm, graph: bool, monkeypatch, **kw):
    """A real request (reasoning + image) with graph decode on or off; returns (text, png, captured)."""
    from engine.runtime.decode_step import DecodeStep
    from engine.runtime.denoise import DenoiseRunner
    from engine.runtime.prefill_step import PrefillStep
    captured = []
    orig, orig_dn, orig_pf = DecodeStep._capture, DenoiseRunner._capture, PrefillStep._capture

    def recording(self):
        orig(self)
        captured.append(self.graph is not None)

    def recording_dn(self, *a):
        orig_dn(self, *a)
        captured.append(("denoise", self._graph is not None))
    def recording_pf(self, b):
        orig_pf(self, b)
        captured.append(("prefill", b in self.graphs))
    monkeypatch.setattr(DecodeStep, "_capture", recording)
    monkeypatch.setattr(DenoiseRunner, "_capture", recording_dn)
    monkeypatch.setattr(PrefillStep, "_capture", recording_pf)
    ev = list(Pipeline(lm, preview_every=0, cuda_graph=graph).run(Request(**kw)))
    monkeypatch.setattr(DecodeStep, "_capture", orig)
    monkeypatch.setattr(DenoiseRunner, "_capture", orig_dn)
    monkeypatch.setattr(PrefillStep, "_capture", orig_pf)
    errors = [e for e in ev if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in ev if isinstance(e, Image))
    return "".join(e.delta for e in ev if isinstance(e, Text)), img.png, captured, ev[-1].timings


@pytest.mark.parametrize("which,dtype", [("tiny", torch.bfloat16), ("embedded", torch.bfloat16),
                                         ("tiny", torch.float32)])
def test_cuda_graph_decode_equals_eager(tiny_dir, which, dtype, monkeypatch):
    """Graph prefill and decode give the eager tokens, token for token, over a whole request (sampled, 64
    new tokens at most), and the graphs really ran (bf16: capture must succeed; fp32 reports whether it
    could)."""
    from engine import EMBEDDED_MODEL
    lm = load(tiny_dir if which == "tiny" else EMBEDDED_MODEL, "cuda", dtype)
    kw = dict(prompt="two red circles and a blue star", bot_task="think_recaption", max_new_tokens=64,
              steps=4, seed=11)
    eager = _run_text(lm, False, monkeypatch, **kw)
    graph = _run_text(lm, True, monkeypatch, **kw)
    print(f"{which} {dtype}: captured {graph[2]}, {graph[3].ar_tokens} tokens, eager "
          f"{eager[3].ar_ms_per_token:.2f} ms/token, graph {graph[3].ar_ms_per_token:.2f} ms/token")
    assert eager[2] == []                             # graphs off: nothing captured
    if dtype == torch.bfloat16:
        assert graph[2] == [("prefill", True), True, ("denoise", True)], f"a graph was not captured: {graph[2]}"
    assert graph[3].ar_tokens >= 8 and graph[0] == eager[0]
    assert graph[1] == eager[1]             # the same CoT, graph denoise steps or eager: the same image bytes


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_same_seed_same_image_twice_on_cuda(tiny_dir, which, monkeypatch):
    """Deterministic kernels (no atomics in the MoE finalize): a seed gives the same bytes every time."""
    from engine import EMBEDDED_MODEL
    lm = load(tiny_dir if which == "tiny" else EMBEDDED_MODEL, "cuda", torch.bfloat16)
    kw = dict(prompt="a green square on black", bot_task="think_recaption", max_new_tokens=48, steps=6, seed=5,
              size="256x256")
    a, b = _run_text(lm, True, monkeypatch, **kw), _run_text(lm, True, monkeypatch, **kw)
    assert a[0] == b[0] and a[1] == b[1]


def test_decode_graph_captured_once_for_many_requests(tiny_dir, monkeypatch):
    """The AR decode graph lives with the pipeline's KV pool: captured at the first request, replayed by
    the next ones (which fit the pool), and a request on the reused pool gives a fresh pipeline's bytes.
    The prefill graphs live there too: one capture per prompt-length bucket, never twice."""
    from engine.runtime.decode_step import DecodeStep
    from engine.runtime.prefill_step import PrefillStep
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    captures, buckets = [], []
    orig, orig_pf = DecodeStep._capture, PrefillStep._capture

    def recording(self):
        orig(self)
        captures.append(self.graph is not None)

    def recording_pf(self, b):
        orig_pf(self, b)
        buckets.append((b, b in self.graphs))
    monkeypatch.setattr(DecodeStep, "_capture", recording)
    monkeypatch.setattr(PrefillStep, "_capture", recording_pf)
    p = Pipeline(lm, preview_every=0)
    first = dict(prompt="three blue triangles on white", bot_task="think_recaption", max_new_tokens=40, steps=3,
                 seed=2)
    second = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=32, steps=3, seed=9)
    outcome(list(p.run(Request(**first))))
    got = outcome(list(p.run(Request(**second))))
    assert captures == [True], f"the decode graph was captured {captures}, not once"
    assert buckets and all(ok for _, ok in buckets) and len({b for b, _ in buckets}) == len(buckets), buckets
    fresh = outcome(list(Pipeline(lm, preview_every=0).run(Request(**second))))
    assert got[0] == fresh[0] and np.array_equal(got[1], fresh[1])
    assert p._kv.allocations == 1


def test_prefill_graph_replays_equal_eager_per_bucket(tiny_dir):
    """Prefill graphs: one per length bucket, replayed for any prompt of that bucket with that prompt's own
    values (two lengths in one bucket, one in the next), bitwise equal to the eager padded prefill, and
    the eager padded prefill equal to the plain forward up to bf16 rounding."""
    from engine.model.attention import KVCache
    from engine.runtime.prefill_step import GRAIN, PrefillStep
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    model, cfg, view = lm.model, lm.cfg, PhaseView()
    n = 3 * GRAIN
    pos = torch.arange(n, device="cuda").unsqueeze(1).repeat(1, 2)
    blocks = torch.full((n,), -1, device="cuda")

    def fresh():
        return KVCache.allocate(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, model.dtype, "cuda")
    graph = PrefillStep(model, fresh(), view, use_graph=True)
    eager, plain = PrefillStep(model, fresh(), view), PrefillStep(model, fresh(), view, padded=False)
    assert graph.use_graph and not eager.use_graph
    with torch.no_grad():
        for L in (GRAIN - 30, GRAIN - 3, GRAIN + 5):
            emb = model.transformer.embed(torch.randint(0, 1000, (1, L), device="cuda"))
            g, e, p = (s(emb, pos, blocks).clone() for s in (graph, eager, plain))
            assert torch.equal(g, e), L
            assert (e - p).abs().max().item() <= 0.05 * p.abs().max().item(), L
            for a, b in zip(graph.cache.k + graph.cache.v, eager.cache.k + eager.cache.v):
                assert torch.equal(a[:, :, :L], b[:, :, :L])
    assert sorted(graph.graphs) == [GRAIN, 2 * GRAIN] and not graph.failed
