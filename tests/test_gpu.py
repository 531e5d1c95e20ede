"""GPU checks (run on the GPU machine: `python -m pytest -m gpu tests/test_gpu.py`)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

import hunyuan_kernels as kernels
from engine.runtime.events import Done, Error, Image, Text
from engine.model.loader import load
from engine.model.moe import MoE
from engine.parallel.layout import PhaseView
from engine.runtime.request import Request
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from engine_drive import make_engine

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
    return outcome(list(make_engine(load(tiny_dir, "cuda", torch.float32), preview_every=0).run(Request(**REQ))))


def test_cuda_fp32_text_equals_cpu(tiny, cuda_fp32):
    cpu = outcome(list(make_engine(tiny, preview_every=0).run(Request(**REQ))))
    assert cuda_fp32[0] == cpu[0]


def test_bf16_close_to_fp32(tiny_dir, cuda_fp32):
    bf = outcome(list(make_engine(load(tiny_dir, "cuda", torch.bfloat16), preview_every=0).run(Request(**REQ))))
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
    with EngineServer(EngineConfig(tiny_dir, device="cuda", dtype="float32", plan=plan, sp_kind=sp, preview_every=0)) as server:
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


def _run_text(lm, graph: bool, **kw):
    """A real request (reasoning + image) with graphs on or off; returns (text, png, captures by key, timings)."""
    pipe = make_engine(lm, preview_every=0, cuda_graph=graph)
    ev = list(pipe.run(Request(**kw)))
    errors = [e for e in ev if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in ev if isinstance(e, Image))
    return "".join(e.delta for e in ev if isinstance(e, Text)), img.png, dict(pipe.graphs.captures), ev[-1].timings


@pytest.mark.parametrize("which,dtype", [("tiny", torch.bfloat16), ("embedded", torch.bfloat16),
                                         ("tiny", torch.float32)])
def test_cuda_graph_decode_equals_eager(tiny_dir, which, dtype):
    """Graph prefill and decode give the eager tokens, token for token, over a whole request (sampled, 64
    new tokens at most), and the graphs really ran: one prefill, decode and denoise graph, each captured
    once (a capture that fails is an error naming its key, never a silent eager run)."""
    from engine import EMBEDDED_MODEL
    lm = load(tiny_dir if which == "tiny" else EMBEDDED_MODEL, "cuda", dtype)
    kw = dict(prompt="two red circles and a blue star", bot_task="think_recaption", max_new_tokens=64,
              steps=4, seed=11)
    eager = _run_text(lm, False, **kw)
    graph = _run_text(lm, True, **kw)
    print(f"{which} {dtype}: captured {graph[2]}, {graph[3].ar_tokens} tokens, eager "
          f"{eager[3].ar_ms_per_token:.2f} ms/token, graph {graph[3].ar_ms_per_token:.2f} ms/token")
    assert eager[2] == {}                             # graphs off: nothing captured
    if dtype == torch.float32:      # the fp32 MoE reference cannot be captured: eager by decision, not by failure
        assert graph[2] == {}
    else:
        assert sorted(k[0] for k in graph[2]) == ["decode", "denoise", "prefill"] and set(graph[2].values()) == {1}
    assert graph[3].ar_tokens >= 8 and graph[0] == eager[0]
    assert graph[1] == eager[1]             # the same CoT, graph denoise steps or eager: the same image bytes


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_same_seed_same_image_twice_on_cuda(tiny_dir, which):
    """Deterministic kernels (no atomics in the MoE finalize): a seed gives the same bytes every time."""
    from engine import EMBEDDED_MODEL
    lm = load(tiny_dir if which == "tiny" else EMBEDDED_MODEL, "cuda", torch.bfloat16)
    kw = dict(prompt="a green square on black", bot_task="think_recaption", max_new_tokens=48, steps=6, seed=5,
              size="256x256")
    a, b = _run_text(lm, True, **kw), _run_text(lm, True, **kw)
    assert a[0] == b[0] and a[1] == b[1]


def test_decode_graph_captured_once_for_many_requests(tiny_dir):
    """The AR graphs live with the pipeline's KV pool: captured at the first request, replayed by the next
    ones (which fit the pool), and a request on the reused pool gives a fresh pipeline's bytes. One
    capture per key, never two."""
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    p = make_engine(lm, preview_every=0)
    first = dict(prompt="three blue triangles on white", bot_task="think_recaption", max_new_tokens=40, steps=3,
                 seed=2)
    second = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=32, steps=3, seed=9)
    outcome(list(p.run(Request(**first))))
    ar_keys = {k for k in p.graphs.captures if k[0] != "denoise"}
    got = outcome(list(p.run(Request(**second))))
    assert {k for k in p.graphs.captures if k[0] != "denoise"} == ar_keys          # nothing new for the AR
    assert set(p.graphs.captures.values()) == {1}, p.graphs.captures
    fresh = outcome(list(make_engine(lm, preview_every=0).run(Request(**second))))
    assert got[0] == fresh[0] and np.array_equal(got[1], fresh[1])
    assert p.pool.allocations == 2                   # the AR slots and the denoise rows, once each


GREEDY_TEXT = ["a red circle", "two blue squares on a long table", "a green star", "a black cat on a roof"]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_batched_decode_equals_per_row_decode(tiny_dir, rows):
    """`rows` greedy requests decoded together (one graph-replayed decode step for all of them a token,
    bf16) give each the ids it gets decoded alone; each decode bucket was captured once. Up to 8 rows: the
    `moe` op's decode variant computes each token alone; above 8 its grouped variants round differently
    (seen at 16 on the H200, 2026-12-02), so the engine batches at most 8 until the decode MoE takes 32."""
    from engine_drive import run_together
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    reqs = [dict(prompt=f"{GREEDY_TEXT[i % 4]} number {i}", bot_task="think", max_new_tokens=24, text_only=True,
                 greedy=True, seed=i) for i in range(rows)]
    events, scheduler = run_together(lm, reqs)
    alone = make_engine(lm, preview_every=0)
    for i, kw in enumerate(reqs):
        want = list(alone.run(Request(**kw)))
        assert isinstance(events[i][-1], Done) and events[i][-1].cot_text == want[-1].cot_text, i
    decode = {k: n for k, n in scheduler.pool.graphs.captures.items() if k[0] == "decode"}
    assert decode and set(decode.values()) == {1}
    assert max(k[1] for k in decode) == scheduler.pool.decode.bucket([rows - 1])


def test_graph_keys_captured_once_across_many_requests(tiny_dir):
    """Three waves of four requests (reasoning and images) on one engine: the AR graphs (prefill per length
    bucket, decode per batch bucket) and the denoise step graphs (per bucket, token layout and rows) are
    captured in the first wave only, once per key. The waves repeat the first one's layouts (greedy
    reasoning of the same prompts) with other seeds: each later request replays its key's step over its
    own noise, and gives the image a fresh engine gives it."""
    from engine_drive import run_together
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    pipe = make_engine(lm, preview_every=0, max_batch=4)
    keys, images = [], []
    for wave in range(3):
        reqs = [dict(prompt=f"{GREEDY_TEXT[i]} in a wave", bot_task="think", max_new_tokens=16 + 4 * i, greedy=True,
                     steps=2, seed=10 * wave + i, size="256x256" if i % 2 else "512x256") for i in range(4)]
        events, _ = run_together(lm, reqs, engine=pipe)
        assert all(isinstance(e[-1], Done) for e in events.values()), [e[-1] for e in events.values()]
        keys.append(set(pipe.graphs.captures))
        images.append([outcome(events[i])[1] for i in range(4)])
    assert keys[0] == keys[1] == keys[2] and {k[0] for k in keys[0]} == {"prefill", "decode", "denoise"}
    assert all(pipe.graphs.captures[k] == 1 for k in keys[0]), pipe.graphs.captures
    denoise = sorted(k for k in keys[0] if k[0] == "denoise" and k in pipe.graphs)
    assert 2 <= len(denoise) <= 4, denoise             # two buckets; the CoT lengths may differ per prompt
    fresh = make_engine(lm, preview_every=0)
    for i in (0, 3):                                    # a replayed step gives what a fresh capture gives
        kw = dict(prompt=f"{GREEDY_TEXT[i]} in a wave", bot_task="think", max_new_tokens=16 + 4 * i, greedy=True,
                  steps=2, seed=20 + i, size="256x256" if i % 2 else "512x256")
        assert psnr(outcome(list(fresh.run(Request(**kw))))[1], images[2][i]) >= 40, i
    print(f"captured: {sorted(keys[0])}")


DENOISE_BATCH = [dict(prompt="a red circle", bot_task="image", size="256x256", steps=3, seed=71),
                 dict(prompt="three small blue squares in a row on a wooden table", bot_task="image", size="256x256",
                      steps=3, seed=72),
                 dict(prompt="a green star", bot_task="image", size="256x256", steps=2, seed=73, guidance=2.5)]


def test_denoise_batch_graphs_on_cuda(tiny_dir):
    """bf16, graphs on: three requests of one bucket (prompts of three lengths) at max_denoise_batch 3 run
    their steps as graphs for one request (the first, before the others joined in turns of their own), two
    and three requests; a second wave captures nothing and
    gives the same bytes; each image is close to its solo image (batched GEMMs may round differently), and
    alone the three prompt lengths share ONE denoise step graph (the key does not depend on the length)."""
    from engine_drive import run_together
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    pipe = make_engine(lm, preview_every=0, max_batch=3, max_denoise_batch=3)
    first, _ = run_together(lm, DENOISE_BATCH, engine=pipe)
    captured = dict(pipe.graphs.captures)
    again, _ = run_together(lm, DENOISE_BATCH, engine=pipe)
    assert dict(pipe.graphs.captures) == captured and set(captured.values()) == {1}, pipe.graphs.captures
    denoise = [k for k in captured if k[0] == "denoise"]
    assert sorted(k[-1] for k in denoise if k[-1][0] == "batch") == [("batch", 2), ("batch", 3)], captured
    assert len(denoise) == 3, captured
    solo = make_engine(lm, preview_every=0)
    for i, kw in enumerate(DENOISE_BATCH):
        a, b, c = outcome(first[i])[1], outcome(again[i])[1], outcome(list(solo.run(Request(**kw))))[1]
        assert np.array_equal(a, b), i
        print(f"request {i}: batched vs alone PSNR {psnr(a, c):.1f} dB")
        assert psnr(a, c) >= 30, i
    assert len([k for k in solo.graphs.captures if k[0] == "denoise"]) == 1, solo.graphs.captures


def test_step_policies_on_cuda_give_the_same_images(tiny_dir):
    """bf16, graphs on, max_denoise_batch 2, K = 2: the overlap policy (the image phase on a low-priority stream,
    the AR work on a high-priority one, the image graphs in a pool of their own, engine/runtime/lanes.py) gives the same tokens and the same image bytes as
    interleave (the same kernels on the same inputs, in the same order on each lane), and waves the same
    tokens and images close to them (other batches)."""
    from engine_drive import run_together
    from test_scheduler import MIXED
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    runs = {}
    for policy in ("interleave", "overlap", "waves"):
        pipe = make_engine(lm, preview_every=0, max_batch=4, max_denoise_batch=2)
        events, scheduler = run_together(lm, MIXED, engine=pipe, policy=policy, decode_steps_per_denoise=2)
        assert (scheduler.lanes.side is not None) == (policy == "overlap")
        if policy == "overlap":      # the AR lane before the image lane where both wait for an SM
            assert scheduler.lanes.ar.priority < scheduler.lanes.side.priority, (scheduler.lanes.ar.priority,
                                                                                  scheduler.lanes.side.priority)
        runs[policy] = [outcome(events[i]) for i in range(len(MIXED))]
    for i in range(len(MIXED)):
        base = runs["interleave"][i]
        assert runs["overlap"][i][0] == runs["waves"][i][0] == base[0], i
        assert np.array_equal(runs["overlap"][i][1], base[1]), i
        print(f"request {i}: waves vs interleave PSNR {psnr(runs['waves'][i][1], base[1]):.1f} dB")
        assert psnr(runs["waves"][i][1], base[1]) >= 30, i


def test_overlap_reuses_slots_and_reference_encodings_behind_a_busy_image_lane(tiny_dir):
    """Overlap never makes the AR lane wait for the image lane's queued steps (engine/runtime/lanes.py): a hand-off's
    AR slot drains until the image lane has read it, and the reference encodings the image phase reads are
    recorded on that lane. Six requests (two edits with a reference image) on two AR slots, a denoise turn after
    every decode step: slots are handed back on the image lane and taken again while it is busy, and every
    request gives the same tokens and image bytes as under interleave."""
    from engine_drive import run_together
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    ref = PILImage.new("RGB", (96, 64), (200, 40, 40))
    reqs = [dict(prompt=f"shape {i}", bot_task="think_recaption", max_new_tokens=6 + 3 * i, steps=3, seed=30 + i,
                 greedy=True) for i in range(4)]
    reqs += [dict(prompt="make it blue", images=[ref], bot_task="think", max_new_tokens=8, steps=3, seed=40),
             dict(prompt="make it green", images=[ref], bot_task="image", steps=3, seed=41)]
    runs, fenced = {}, []
    for policy in ("interleave", "overlap"):
        pipe = make_engine(lm, preview_every=1, max_batch=2, max_denoise_batch=2)

        def watch(scheduler):          # the lanes' fence, which each step hands the pool (scheduler.py `step`)
            fence = scheduler.lanes.fence
            scheduler.lanes.fence = lambda: fenced.append(fence()) or fenced[-1]
        events, _ = run_together(lm, reqs, engine=pipe, on_start=watch, policy=policy, decode_steps_per_denoise=1)
        runs[policy] = [outcome(events[i]) for i in range(len(reqs))]
    assert len([e for e in fenced if e is not None]) >= 4          # hand-offs gave their slots back on the lane
    for i in range(len(reqs)):
        assert runs["overlap"][i][0] == runs["interleave"][i][0], i
        assert np.array_equal(runs["overlap"][i][1], runs["interleave"][i][1]), i


def test_prefill_graph_replays_equal_eager_per_bucket(tiny_dir):
    """Prefill graphs: one per length bucket, replayed for any prompt of that bucket with that prompt's own
    values (two lengths in one bucket, one in the next), bitwise equal to the eager padded prefill, and
    the eager padded prefill equal to the plain forward up to bf16 rounding."""
    from engine.model.attention import KVCache
    from engine.runtime.graphs import Graphs
    from engine.runtime.prefill_step import GRAIN, PrefillStep
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    model, cfg, view = lm.model, lm.cfg, PhaseView()
    n = 3 * GRAIN
    pos = torch.arange(n, device="cuda").unsqueeze(1).repeat(1, 2)
    blocks = torch.full((n,), -1, device="cuda")

    def fresh():
        return KVCache.allocate(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, model.dtype, "cuda")
    graph = PrefillStep(model, fresh(), view, use_graph=True, graphs=Graphs())
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
    assert sorted(k[1] for k in graph.graphs.captures) == [GRAIN, 2 * GRAIN]
    assert set(graph.graphs.captures.values()) == {1}


def test_conversation_turns_on_cuda(tiny_dir):
    """Issue 29: a conversation's turn on CUDA (bf16, graphs on): under `last_image` it is the plain edit of
    the last image, byte for byte; under `full` (the earlier turn whole: a longer prompt, 2 images) it runs
    and differs."""
    from engine.runtime.history import Turn, reasoning_of
    pipe = make_engine(load(tiny_dir, "cuda", torch.bfloat16), preview_every=0)
    kw = dict(bot_task="think_recaption", max_new_tokens=8, steps=3, seed=3, greedy=True, size="256x256")
    ev = list(pipe.run(Request(prompt="a red circle", **kw)))
    first = outcome(ev)
    png = next(e for e in ev if isinstance(e, Image)).png
    history = (Turn("a red circle", (), reasoning_of("think_recaption", ev[-1].cot_text), png),)
    chained = outcome(list(pipe.run(Request(prompt="make it blue", history=history, history_policy="last_image",
                                            **kw))))
    plain = outcome(list(pipe.run(Request(prompt="make it blue", images=[png], **kw))))
    assert chained[0] == plain[0] and np.array_equal(chained[1], plain[1])
    full = outcome(list(pipe.run(Request(prompt="make it blue", history=history, history_policy="full", **kw))))
    assert full[1].shape == first[1].shape and not np.array_equal(full[1], plain[1])


def test_warmup_captures_what_default_requests_need(tiny_dir):
    """After `warm_up` (engine/runtime/warmup.py) every decode bucket, prefill bucket and the square bucket's
    denoise keys are captured, once; four requests together at that size (reasoning or not, prompts short
    and long) then capture nothing, and each gives the image a fresh engine gives it."""
    from engine_drive import run_together
    from engine.runtime.prefill_step import GRAIN, GRAPH_MAX
    from engine.runtime.warmup import warm_up
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    pipe = make_engine(lm, preview_every=0, max_batch=4)
    w = warm_up(pipe)
    captured = dict(pipe.graphs.captures)
    assert w.graphs == len(captured) and set(captured.values()) == {1}, captured
    assert sorted(k[1] for k in captured if k[0] == "decode") == [1, 2, 4], captured
    assert sorted(k[1] for k in captured if k[0] == "prefill") == list(range(GRAIN, GRAPH_MAX + 1, GRAIN)), captured
    assert len([k for k in captured if k[0] == "denoise"]) == 6, captured
    reqs = [dict(prompt=f"{GREEDY_TEXT[i]} after a warm-up" + " with boats" * (60 * i), bot_task=task,
                 max_new_tokens=16 + 4 * i, greedy=True, steps=2, seed=40 + i, size="256x256")
            for i, task in enumerate(("think", "image", "recaption", "think_recaption"))]
    events, _ = run_together(lm, reqs, engine=pipe)
    assert all(isinstance(e[-1], Done) for e in events.values()), [e[-1] for e in events.values()]
    assert dict(pipe.graphs.captures) == captured, set(pipe.graphs.captures) - set(captured)
    fresh = make_engine(lm, preview_every=0)
    for i in (0, 3):
        assert psnr(outcome(list(fresh.run(Request(**reqs[i]))))[1], outcome(events[i])[1]) >= 40, i
    print(f"warm-up: {w.seconds:.1f} s, {w.graphs} graphs")


@pytest.mark.parametrize("policy", ["interleave", "overlap"])
def test_decode_lookahead_on_cuda_gives_the_same_bits(tiny_dir, policy):
    """bf16, graphs on: each decode step launched before the host reads the last one's tokens (the
    tokens copied on the device, read through pinned memory) gives every request the same tokens and
    image bytes as the plain step, and the launches ahead were used (few steps ran their own forward)."""
    from engine.runtime.decode_step import DecodeStep
    from engine_drive import run_together
    from test_scheduler import MIXED
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    runs, own = {}, []
    call = DecodeStep.__call__
    DecodeStep.__call__ = lambda step, rows: own.append(1) or call(step, rows)
    try:
        for lookahead in (False, True):
            own.clear()
            pipe = make_engine(lm, preview_every=0, max_batch=4, decode_lookahead=lookahead)
            events, scheduler = run_together(lm, MIXED, engine=pipe, policy=policy, decode_steps_per_denoise=2)
            assert scheduler.lookahead == lookahead
            runs[lookahead] = [outcome(events[i]) for i in range(len(MIXED))], len(own)
    finally:
        DecodeStep.__call__ = call
    (plain, own_plain), (ahead, own_ahead) = runs[False], runs[True]
    for i in range(len(MIXED)):
        assert ahead[i][0] == plain[i][0] and np.array_equal(ahead[i][1], plain[i][1]), i
    assert own_ahead < own_plain, (own_ahead, own_plain)


def test_previews_leave_the_engine_loop_without_a_host_sync(tiny_dir):
    """On CUDA a step preview's pixels are copied to pinned memory behind its step (images.HostPixels, no
    host sync in the engine's loop) and read where its PNG is asked for: the PNG holds those pixels."""
    from engine.runtime.events import Step
    from engine.runtime.images import HostPixels
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    events = list(make_engine(lm, preview_every=1, preview_share=1.0).run(Request(**REQ)))
    steps = [e for e in events if isinstance(e, Step) and e.preview_data is not None]
    assert steps and all(isinstance(e.preview_data, HostPixels) for e in steps)
    for e in steps:
        pixels = np.asarray(e.preview_data)
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        png = PILImage.open(io.BytesIO(e.preview))
        assert png.format == "PNG" and np.array_equal(np.asarray(png.convert("RGB")), pixels)
    outcome(events)


def test_a_request_has_no_device_wide_sync_and_still_times_its_phases(tiny_dir, monkeypatch):
    """After the first request (its graphs captured), a request with previews runs without one
    torch.cuda.synchronize (its phases timed by CUDA events, engine/runtime/span.py; previews through pinned
    memory), so the engine's loop never stops for a whole stretch of device work; its timings are all there."""
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    pipe = make_engine(lm, preview_every=1, preview_share=1.0)
    list(pipe.run(Request(**REQ)))
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a) or real(*a))
    events = list(pipe.run(Request(**REQ)))
    t = events[-1].timings
    assert calls == [], len(calls)
    assert t.dit_prefill_ms > 0 and t.dit_ms_per_step > 0 and t.vae_ms > 0 and t.total_s > 0
    outcome(events)


def test_the_final_image_and_its_timings_leave_the_loop_without_a_host_wait(tiny_dir, monkeypatch):
    """The engine's loop never waits for a request's last step and VAE decode: the image leaves as pixels on
    their way to the host (images.HostPixels) and Done's device timings settle where they are read
    (events.Done.later), so nothing during the engine's steps reads them; read afterwards, the pixels are the
    ones the same request gave before and every timing is there."""
    from engine.runtime.images import HostPixels
    from engine.runtime.span import Span
    from engine_drive import run_together
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    engine = make_engine(lm, preview_every=0, max_batch=2)
    before = outcome(list(engine.run(Request(**REQ))))         # graphs captured; its image read at once
    waits = []
    real_array, real_ms = HostPixels.__array__, Span.ms
    monkeypatch.setattr(HostPixels, "__array__", lambda *a, **k: waits.append("pixels") or real_array(*a, **k))
    monkeypatch.setattr(Span, "ms", lambda self: waits.append("span") or real_ms(self))
    events, _ = run_together(lm, [REQ], engine=engine)
    assert waits == [], waits                  # nothing read them while the engine stepped
    img = next(e for e in events[0] if isinstance(e, Image))
    assert isinstance(img.data, HostPixels) and isinstance(events[0][-1], Done)
    after = outcome(events[0])                 # reads the pixels (the PNG) and then the timings
    assert after[0] == before[0] and np.array_equal(after[1], before[1])
    t = after[2]
    assert t.dit_prefill_ms > 0 and t.dit_ms_per_step > 0 and t.vae_ms > 0 and t.total_s > 0
    assert "pixels" in waits and "span" in waits


def test_graph_captures_while_another_thread_waits_on_events():
    """The engine loop captures graphs for new keys while the worker's sender thread waits on CUDA events (an
    image's pixels on their way to the host, a request's timings): in CUDA's default ("global") capture mode
    such a wait in another thread invalidates the capture. Graphs captures thread-locally: 24 captures beside
    a thread that queries and synchronizes the loop's events without pause all succeed and replay right."""
    import threading
    from engine.runtime.graphs import Graphs
    graphs, stop, waits, latest = Graphs(), threading.Event(), [0], [None]

    def sender():            # as engine/serve/worker.py's Sender: events the loop recorded, waited on here
        while not stop.is_set():
            ev = latest[0]
            if ev is not None:
                ev.query()
                ev.synchronize()
                waits[0] += 1

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    try:
        a = torch.randn(512, 512, device="cuda")
        for i in range(24):
            b = torch.full((512, 512), float(i), device="cuda")
            ev = torch.cuda.Event()
            ev.record()                            # the loop's earlier work, as a HostPixels copy records it
            latest[0] = ev
            out = graphs.replay(("probe", i), lambda b=b: (a @ b).relu())
            torch.testing.assert_close(out, (a @ b).relu())
    finally:
        stop.set()
        t.join(10)
    assert waits[0] > 0 and sum(graphs.captures.values()) == 24
