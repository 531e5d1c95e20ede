"""LoRA adapters as PEFT writes them (the real `peft` library, on a module tree with the checkpoint's layer
names and shapes), applied unmerged: an adapter changes the output and equals a checkpoint with the
merged weights (greedy text identical, image >= 40 dB, fp32 CPU), a request without one equals the base
model bit for bit, requests with different adapters in one batch each give what they give alone, and
folders that cannot be served are refused with a message naming why."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from safetensors.torch import load_file, save_file

from engine.model.loader import load
from engine.model.lora import load_adapter
from engine.model.peft import ALL_TARGETS, AdapterError, read_peft
from engine.runtime.events import Error, Image, Text
from engine.runtime.request import Request, RequestError, prepare
from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine_drive import backbone_rows, make_engine, run_together
from tools.tiny_lora import make_adapter, random_adapter

REQUEST = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True)
TAIL = 16 * 16 + 1          # a 256x256 denoise step's tokens on the tiny model: <timestep> + 16x16 latent tokens
MLP_TARGETS = ["qkv_proj", "o_proj", "gate_and_up_proj", "down_proj"]      # the trainers' optional MLP targets


# ----------------------------------------------------------------------------- adapters made by peft
def merged_checkpoint(src: Path, dst: Path, adapter: Path, cfg: ModelConfig) -> Path:
    """A copy of the checkpoint with W + scale B A in every adapted linear (stored in fp32: no rounding)."""
    shutil.copytree(src, dst)
    layers = read_peft(adapter, cfg, targets=ALL_TARGETS).layers
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for layer, w in layers.items():
            key = names.weight(layer)
            if key in tensors:
                tensors[key] = tensors[key].float() + w.scale * (w.b @ w.a)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def cfg(tiny) -> ModelConfig:
    return tiny.cfg


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, cfg) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"plain": make_adapter(root / "plain", cfg, seed=1),
            # rsLoRA with per-module rank and alpha: PEFT's scale alpha / sqrt(r), the patterns as PEFT matches them
            "patterned": make_adapter(root / "patterned", cfg, seed=2, r=4, lora_alpha=8, use_rslora=True,
                                      rank_pattern={"layers.1.self_attn.o_proj": 2}, alpha_pattern={"o_proj": 3}),
            # the MLPs too: the shared MLP's and every expert's gate_and_up_proj and down_proj
            "mlp": make_adapter(root / "mlp", cfg, seed=4, target_modules=MLP_TARGETS)}


@pytest.fixture(scope="module")
def served(tiny_dir, adapters):
    """The tiny checkpoint with the three adapters loaded in tables that hold the MLPs too (its own copy of the
    model: the tables are its own)."""
    lm = load(tiny_dir)
    tables = lm.model.enable_lora(capacity=4, max_rank=8, mlp=True)
    for name, folder in adapters.items():
        load_adapter(tables, name, folder)
    return lm


def outcome(events: list) -> tuple[str, np.ndarray]:
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    text = "".join(e.delta for e in events if isinstance(e, Text))
    img = next(e for e in events if isinstance(e, Image))
    return text, np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def differs(a: tuple[str, np.ndarray], b: tuple[str, np.ndarray]) -> bool:
    """Another text, image size (the model chose another ratio) or image (< 30 dB)."""
    return a[0] != b[0] or a[1].shape != b[1].shape or psnr(a[1], b[1]) < 30


def alone(lm, **kw) -> tuple[str, np.ndarray]:
    return outcome(list(make_engine(lm, preview_every=0).run(Request(**(REQUEST | kw)))))


@pytest.fixture(scope="module")
def base(tiny):
    return alone(tiny)


# ----------------------------------------------------------------------------- reading PEFT folders
def test_reads_what_peft_wrote(adapters, cfg):
    """Every adapted layer's A/B at its rank, and PEFT's scale: alpha / r, or alpha / sqrt(r) with rslora
    and the rank / alpha patterns (o_proj: alpha 3; layer 1's o_proj: rank 2)."""
    plain = read_peft(adapters["plain"], cfg)
    n = [names.layer(i) for i in range(cfg.num_layers)]
    assert set(plain.layers) == {x for i in n for x in (i.qkv_proj, i.o_proj)}
    assert {w.rank for w in plain.layers.values()} == {8} and {w.scale for w in plain.layers.values()} == {2.0}
    pat = read_peft(adapters["patterned"], cfg).layers
    assert (pat[n[0].qkv_proj].rank, pat[n[0].qkv_proj].scale) == (4, 8 / 2)
    assert (pat[n[0].o_proj].rank, pat[n[0].o_proj].scale) == (4, 3 / 2)
    assert pat[n[1].o_proj].rank == 2 and pat[n[1].o_proj].scale == pytest.approx(3 / 2 ** 0.5)
    assert all(w.b.abs().sum() > 0 for w in pat.values())


# ----------------------------------------------------------------------------- the adapter's effect on tp1
@pytest.mark.parametrize("adapter", ["plain", "patterned", "mlp"])
def test_adapter_equals_merged_checkpoint(served, base, tiny_dir, adapters, cfg, tmp_path, adapter):
    """The unmerged adapter gives the merged checkpoint's greedy text and image (>= 40 dB), and differs from the
    base model; an adapter of the MLPs too (applied inside the experts by the `moe_lora` op) as well."""
    got = alone(served, lora=adapter)
    merged = alone(load(merged_checkpoint(tiny_dir, tmp_path / "merged", adapters[adapter], cfg)))
    assert got[0] == merged[0]
    assert psnr(got[1], merged[1]) >= 40
    assert differs(got, base)                                       # it does change the output


def test_lora_scale_is_the_strength(served, base):
    """lora_scale s scales the low-rank update: s and 2s give different images, both unlike the base model."""
    one, two = alone(served, lora="plain"), alone(served, lora="plain", lora_scale=2.0)
    assert differs(one, two) and differs(two, base)


def test_no_adapter_equals_the_base_model(served, base):
    """A request without an adapter on an engine with adapter tables: the base model's text and image, bit
    for bit (slot 0 adds exact zeros)."""
    got = alone(served)
    assert got[0] == base[0] and np.array_equal(got[1], base[1])


def test_different_adapters_in_one_batch_each_equal_their_solo_run(served):
    """Three requests decoded together (one batched decode forward, one row each): no adapter, one and the
    other; each gives its solo run's greedy text and image."""
    kws = [REQUEST, REQUEST | dict(lora="plain"), REQUEST | dict(lora="patterned", lora_scale=0.5)]
    events, scheduler = run_together(served, kws)
    assert scheduler.pool.decode.forwards < sum(kw["max_new_tokens"] for kw in kws)    # they shared steps
    for i, kw in enumerate(kws):
        want, got = alone(served, **kw), outcome(events[i])
        assert got[0] == want[0], i
        assert psnr(got[1], want[1]) >= 40, i
    assert differs(outcome(events[1]), outcome(events[0])) and differs(outcome(events[2]), outcome(events[0]))


def test_adapters_share_denoise_batches_and_each_equal_their_solo_run(served):
    """max_denoise_batch 3: a request with one adapter, one without and one with the other adapter (steps 2, 3,
    3; one bucket) denoise in shared forwards, each denoise row with its request's adapter (CFG rows too).
    Each joins the batch in a turn of its own between forwards (engine/runtime/scheduler.py), so the first
    steps alone, then beside the second (two adapters in one forward); when it ends, the third joins and the
    other two share forwards (no adapter beside the other adapter, moved down into the rows the first left).
    Each gives its solo run's text and image."""
    one = REQUEST | dict(size="256x256", steps=3)          # one bucket: the batch may take all three
    kws = [one | dict(lora="plain", steps=2), one, one | dict(lora="patterned", lora_scale=0.5)]
    with backbone_rows(served, tokens=True) as calls:
        events, scheduler = run_together(served, kws, engine=make_engine(served, preview_every=0, max_batch=3,
                                                                        max_denoise_batch=3))
    steps = [rows for rows, tokens in calls if tokens == TAIL]
    assert steps == [2, 4, 4, 4, 2], calls                 # 1; 1+2; 2+3 (twice); 3
    for i, kw in enumerate(kws):
        want, got = alone(served, **kw), outcome(events[i])
        assert got[0] == want[0] and psnr(got[1], want[1]) >= 40, i
    images = [outcome(events[i]) for i in range(3)]
    assert differs(images[0], images[1]) and differs(images[2], images[1])


def test_mlp_adapter_shares_batches_and_each_request_equals_its_solo_run(served):
    """An adapter of the MLPs beside one of the attention projections and none, decoded together (mode
    "rows+mlp": the MoE runs `moe_lora` and the base op, each row keeping its own adapter's output), then
    denoised in shared forwards (each joining in a turn of its own: the MLP adapter's request alone, then
    beside the one without, then that one beside the third): each request gives its solo run's text and
    image; the one without an adapter its solo run's."""
    one = REQUEST | dict(size="256x256", steps=2)
    kws = [one | dict(lora="mlp"), one, one | dict(lora="plain", lora_scale=0.5)]
    pipe = make_engine(served, preview_every=0, max_batch=3, max_denoise_batch=3)
    with backbone_rows(served, tokens=True) as calls:
        events, scheduler = run_together(served, kws, engine=pipe)
    assert scheduler.pool.decode.forwards < sum(kw["max_new_tokens"] for kw in kws)    # shared decode steps
    assert [rows for rows, tokens in calls if tokens == TAIL] == [2, 4, 4, 2], calls          # and denoise steps
    got = [outcome(events[i]) for i in range(3)]
    for i, kw in enumerate(kws):
        want = alone(served, **kw)
        assert got[i][0] == want[0] and psnr(got[i][1], want[1]) >= 40, i
    assert differs(got[0], got[1]) and differs(got[0], got[2])


def test_step_graphs_are_kept_per_lora_mode(served):
    """Denoise step graphs (EagerGraphs: a key's first forward is what its later replays run, as a CUDA graph)
    of one step key: a request without an adapter, then one with, then both kinds in one batch; the step key
    has a graph for the base step, one for a step adding one adapter, and the batched key one for rows with
    different adapters: each request gives its solo run (no graphs)."""
    from test_scheduler import EagerGraphs
    graphs = EagerGraphs()
    pipe = make_engine(served, preview_every=0, max_batch=2, max_denoise_batch=2, graphs=graphs)
    one = REQUEST | dict(size="256x256", steps=2)
    kws = [one, one | dict(lora="plain"), one | dict(lora="patterned", lora_scale=0.5)]
    got = [outcome(list(pipe.run(Request(**kw)))) for kw in kws[:2]]
    events, _ = run_together(served, [kws[0], kws[2]], engine=pipe)
    got += [outcome(events[0]), outcome(events[1])]
    for kw, image in zip([*kws[:2], kws[0], kws[2]], got):
        want = alone(served, **kw)
        assert image[0] == want[0] and psnr(image[1], want[1]) >= 40, kw
    keys = [k for k in graphs.captures if k[0] == "denoise"]
    lora_parts = sorted(tuple(p for p in k if isinstance(p, tuple) and p[:1] in (("batch",), ("lora",))) for k in keys)
    assert lora_parts == [(), (("batch", 2), ("lora", "rows")), (("lora", "one"),)], keys
    assert set(graphs.captures.values()) == {1}


def test_rows_mode_is_decided_when_rows_are_set(cfg, tmp_path, tiny):
    """RowAdapters decides on the host, as rows are set, how a forward over them applies adapters: no row in
    use with one: "off" (no LoraRows, nothing added); all the same one: "one" (its slot once, [1]: one A and B
    per layer, not one per row); else "rows" (each row's own). Idle rows do not count. The one-slot form adds
    what the per-row form adds, and idle rows (strength 0) get nothing."""
    from engine.model.lora import LoraTables, RowAdapters
    from engine.parallel.layout import PhaseView, ShardLayout
    from tools.tiny_lora import random_adapter
    tables = LoraTables(cfg, ShardLayout(), 2, 8, torch.float32, "cpu")
    tables.install("a", random_adapter(cfg, 8, seed=1))
    tables.install("b", random_adapter(cfg, 4, seed=2))
    rows = RowAdapters(tables, 4)
    assert rows.mode == "off" and rows.rows(slice(0, 4)) is None
    rows.set(0, 1, 0.5)
    rows.set(2, 1, 2.0)                        # rows 1 and 3 idle
    one = rows.rows(slice(0, 4))
    assert rows.mode == "one" and one.slot.tolist() == [1] and rows.rows(slice(0, 4)) is one    # made once
    x = torch.randn(4, 3, cfg.hidden_size)
    got, want = (torch.zeros(4, 3, tables.qkv_out) for _ in range(2))
    one.add_qkv(got, x, 1, PhaseView())
    rows.rows(slice(0, 4), "rows").add_qkv(want, x, 1, PhaseView())
    torch.testing.assert_close(got, want)
    assert got[0].abs().sum() > 0 and not got[1].any() and not got[3].any()
    rows.set(1, 2, 1.0)
    assert rows.mode == "rows" and rows.rows(slice(0, 4)).slot.tolist() == [1, 2, 1, 0]
    rows.clear(1)
    assert rows.mode == "one"
    rows.set(3, 0, 0.0)                        # a request without an adapter among them: each row its own
    assert rows.mode == "rows"
    rows.clear(slice(0, 3))
    assert rows.mode == "off" and rows.row(3) is None
    rows.set(slice(2, 4), 2, 1.0)
    rows.copy(slice(0, 2), slice(2, 4))        # rows 2, 3 moved to 0, 1 (a denoise batch's leave) ...
    rows.clear(slice(2, 4))                    # ... and the rows left behind idle
    assert rows.of(1) == (2, 1.0) and rows.slot.tolist() == [2, 2, 0, 0] and rows.mode == "one"
    assert rows.common.tolist() == [2]
    # an adapter of the MLPs among those in use: "+mlp" (the MoE applies it); only a mixed view selects per row
    mlp = LoraTables(cfg, ShardLayout(), 2, 8, torch.float32, "cpu", mlp=True)
    mlp.install("a", random_adapter(cfg, 8, seed=1))
    mlp.install("m", read_peft(make_adapter(tmp_path / "m", cfg, seed=4, target_modules=MLP_TARGETS), cfg,
                               targets=mlp.targets))
    assert mlp.mlp_slots == {2} and mlp.adapts_mlp.tolist() == [False, False, True]
    rows = RowAdapters(mlp, 3)
    rows.set(0, 1, 1.0)
    assert rows.mode == "one" and not rows.rows(slice(0, 3)).mlp
    rows.set(1, 2, 1.0)
    view = rows.rows(slice(0, 3))
    assert rows.mode == "rows+mlp" and view.mlp and view.select
    moe = tiny.model.transformer.layers[1].mlp                  # rows without an MLP adapter: the base op's output
    x = torch.randn(3, 5, cfg.hidden_size)
    got, want = moe(x, PhaseView(), view, 1), moe(x, PhaseView())
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and not torch.allclose(got[1], want[1])
    assert rows.row(1).mlp and not rows.row(1).select and rows.row(0) is not None and not rows.row(0).mlp
    rows.clear(0)
    assert rows.mode == "one+mlp" and not rows.rows(slice(0, 3)).select
    mlp.remove("m")
    assert mlp.mlp_slots == set() and not mlp.mlp[0].a1[:, 2].any()


# ----------------------------------------------------------------------------- the merged fast path
def test_merged_adapter_equals_the_unmerged_one(served, tiny_dir, adapters):
    """The adapter folded into the weights at load (merge_adapter, at lora_scale 0.5) gives the unmerged
    adapter's greedy text and image (>= 40 dB, fp32); the merged engine has no adapter tables, serves only
    that adapter at that strength, and refuses a request without it or at another strength by name."""
    from engine.model.lora_merge import merge_adapter
    lm = load(tiny_dir)
    merge_adapter(lm.model, read_peft(adapters["patterned"], lm.cfg), 0.5, name="patterned")
    got, want = alone(lm, lora="patterned", lora_scale=0.5), alone(served, lora="patterned", lora_scale=0.5)
    assert got[0] == want[0] and psnr(got[1], want[1]) >= 40
    assert lm.model.lora is None and make_engine(lm, preview_every=0).adapters() == ["patterned"]
    for kw, field in ((dict(), "lora"), (dict(lora="patterned"), "lora_scale")):
        events = list(make_engine(lm, preview_every=0).run(Request(**(REQUEST | kw))))
        assert [(e.kind, e.param) for e in events if isinstance(e, Error)] == [("invalid", field)], kw
    with pytest.raises(ValueError, match="merged into the weights: no adapter tables"):
        lm.model.enable_lora(1, 8)


def test_each_rank_merges_its_slice(tiny_dir, adapters, cfg):
    """A hybrid4 rank (storage shard 1 of 2, two micros) folds into its qkv_proj rows and o_proj columns
    exactly its shard of the whole merged update."""
    from engine.model.lora_merge import merge_adapter
    from engine.model.packed import shard_block
    from engine.parallel.plan import get_plan
    layout = get_plan("hybrid4").layout(3)
    base, rank = load(tiny_dir, layout=layout), load(tiny_dir, layout=layout)
    merge_adapter(rank.model, read_peft(adapters["plain"], cfg, layout))
    whole = read_peft(adapters["plain"], cfg).layers
    for i in range(cfg.num_layers):
        n, got, was = names.layer(i), rank.model.transformer.layers[i].self_attn, base.model.transformer.layers[i].self_attn
        w = whole[n.qkv_proj]
        d = (w.scale * w.b @ w.a)[shard_block(w.b.shape[0], layout)]
        torch.testing.assert_close(got.qkv - was.qkv, d.view(got.qkv.shape))
        w = whole[n.o_proj]
        torch.testing.assert_close(got.o_proj - was.o_proj, (w.scale * w.b @ w.a)[:, shard_block(w.a.shape[1], layout)])


def test_merged_mlp_adapter_equals_the_merged_checkpoint(tiny_dir, cfg, tmp_path, base):
    """An adapter of the MLPs too (PEFT's gate_and_up_proj / down_proj: the shared MLP and every expert), merged
    into the weights: the engine with it merged gives the merged checkpoint's greedy text and image
    (>= 40 dB, fp32) and differs from the base model; a hybrid4 rank's merged packs (gate/up rows per micro,
    down columns) equal that rank's load of the merged checkpoint."""
    from engine.model.lora_merge import merge_adapter
    from engine.parallel.plan import get_plan
    folder = make_adapter(tmp_path / "mlp", cfg, seed=4, target_modules=MLP_TARGETS)
    adapter = read_peft(folder, cfg, targets=ALL_TARGETS)
    n = names.layer(1)
    assert {n.shared("gate_and_up_proj"), n.expert(0, "down_proj")} <= set(adapter.layers)
    merged_dir = merged_checkpoint(tiny_dir, tmp_path / "merged", folder, cfg)
    lm = load(tiny_dir)
    merge_adapter(lm.model, adapter, name="mlp")
    got, want = alone(lm, lora="mlp"), alone(load(merged_dir))
    assert got[0] == want[0] and psnr(got[1], want[1]) >= 40 and differs(got, base)
    layout = get_plan("hybrid4").layout(3)
    rank, ref = load(tiny_dir, layout=layout), load(merged_dir, layout=layout)
    merge_adapter(rank.model, read_peft(folder, cfg, layout, ALL_TARGETS))
    for (name, got_p), (_, want_p) in zip(rank.model.transformer.named_parameters(),
                                          ref.model.transformer.named_parameters()):
        torch.testing.assert_close(got_p, want_p, msg=name)
    with pytest.raises(AdapterError, match="not the MLPs: start it with --lora-mlp"):
        read_peft(folder, cfg)                        # tables of the attention projections only
    with pytest.raises(AdapterError, match=r"adapts the MLPs \(model.layers.0.mlp.experts.0.down_proj\); this "
                                           "engine's adapter tables hold the attention projections only"):
        load(tiny_dir).model.enable_lora(1, 8).install("mlp", adapter)


def test_merging_into_quantized_weights_is_refused(tmp_path):
    """Resident MXFP8 packs: W + BA is not in the codes' grid, so the merge is refused before any weight
    changes, naming the layer and the format (the adapter is served unmerged instead)."""
    from engine.model.lora_merge import merge_adapter
    from tools.tiny import make_tiny
    lm = load(make_tiny(tmp_path / "mxfp8", blocks=True, quant="mxfp8"), resident="quantized")
    adapter = read_peft(make_adapter(tmp_path / "adapter", lm.cfg, seed=1), lm.cfg)
    with pytest.raises(AdapterError, match=r"model.layers.0.self_attn.qkv_proj is kept quantized \(mxfp8\).*"
                                           "serve the adapter unmerged"):
        merge_adapter(lm.model, adapter)
    assert lm.model.merged_lora is None


def test_server_serves_a_merged_adapter(served, tiny_dir, adapters):
    """EngineServer(lora_merged=True) (app.py --lora NAME=PATH --lora-merged): its worker folds the adapter into
    the weights; a request naming it gives the unmerged adapter's text and image, one without it is refused
    where it enters; loading another adapter is refused."""
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    with pytest.raises(ValueError, match="needs exactly one --lora"):
        EngineServer(EngineConfig(tiny_dir, loras=list(adapters.items()), lora_merged=True))
    with EngineServer(EngineConfig(tiny_dir, preview_every=0, loras=[("plain", adapters["plain"])], lora_merged=True)) as server:
        assert server.wait_ready(300), server.health()
        assert server.config.lora_slots == 0 and server.adapters() == ["plain"] and server.merged_adapter() == "plain"
        got = outcome(list(server.stream(Request(**(REQUEST | dict(lora="plain"))))))
        refused = list(server.stream(Request(**REQUEST)))            # at submit: never queued
        assert [(e.kind, e.param) for e in refused] == [("invalid", "lora")] and "must name it" in refused[0].message
        with pytest.raises(ValueError, match="merged into its weights"):
            server.load_adapter("patterned", adapters["patterned"])
    want = alone(served, lora="plain")
    assert got[0] == want[0] and psnr(got[1], want[1]) >= 40


# ----------------------------------------------------------------------------- what is refused
def test_request_names_a_loaded_adapter(served):
    adapters = make_engine(served, preview_every=0).adapters()
    assert sorted(adapters) == ["mlp", "patterned", "plain"]
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'; the loaded ones are mlp, patterned, plain") as e:
        prepare(Request("a cat", lora="nope", seed=1), served, adapters)
    assert e.value.field == "lora"
    with pytest.raises(RequestError, match=r"the LoRA strength \(lora_scale\) must be a number in \(0, 4\]") as e:
        prepare(Request("a cat", lora="plain", lora_scale=0, seed=1), served, adapters)
    assert e.value.field == "lora_scale"


def test_mlp_tables_are_asked_for_or_follow_the_start_adapters(tiny_dir, adapters):
    """An engine holds MLP tables with --lora-mlp, or by itself when an adapter loaded at start adapts the MLPs
    (known from the file's header); without them an MLP adapter loaded at run time is refused, naming the flag."""
    from engine.serve.adapters import check_load, needs_mlp
    from engine.serve.info import ModelInfo
    assert needs_mlp((("mlp", str(adapters["mlp"])),)) and not needs_mlp((("plain", str(adapters["plain"])),))
    assert not needs_mlp((("mlp", str(adapters["mlp"])),), merged=True)
    info = ModelInfo.from_folder(tiny_dir)
    with pytest.raises(ValueError, match="not the MLPs: start it with --lora-mlp"):
        check_load(info, (), 2, 64, "mlp", adapters["mlp"])
    assert check_load(info, (), 2, 64, "mlp", adapters["mlp"], mlp=True) == str(adapters["mlp"].resolve())


def _edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return folder


@pytest.mark.parametrize("case,message", [
    ("dora", "use_dora = True is not supported: DoRA"),
    ("modules_to_save", "modules_to_save = \\['lm_head'\\] is not supported"),
    ("mlp", "it adapts model.layers.0.mlp.experts.0.gate_and_up_proj; this engine's adapter tables hold the "
            r"attention projections \(qkv_proj, o_proj\), not the MLPs: start it with --lora-mlp"),
    ("unknown", "it adapts 'model.layers.0.self_attn.qkv', which is not a linear layer of this model"),
    ("beyond", "it adapts 'model.layers.2.self_attn.qkv_proj', which is not a linear layer of this model"),
    ("shape", r"o_proj has lora_A \(8, 128\) and lora_B \(32, 8\); this model's layer is \[64, 128\] at rank 8, "
              r"so they must be \(8, 128\) and \(64, 8\)"),
    ("no_weights", "no adapter_model.safetensors"),
])
def test_unservable_folders_are_refused(tmp_path, cfg, case, message):
    """Each folder as peft (or a hand edit) leaves it, refused with the reason."""
    folder = tmp_path / case
    if case == "dora":
        make_adapter(folder, cfg, seed=3, use_dora=True)
    elif case == "modules_to_save":
        make_adapter(folder, cfg, seed=3)
        _edit_config(folder, modules_to_save=["lm_head"])
    elif case == "mlp":
        make_adapter(folder, cfg, seed=3, target_modules=["qkv_proj", "gate_and_up_proj"])
    elif case in ("unknown", "beyond"):
        make_adapter(folder, cfg, seed=3)
        f = folder / "adapter_model.safetensors"
        t = load_file(str(f))
        old = "model.layers.0.self_attn.qkv_proj" if case == "unknown" else "model.layers.1.self_attn.qkv_proj"
        new = "model.layers.0.self_attn.qkv" if case == "unknown" else "model.layers.2.self_attn.qkv_proj"
        save_file({k.replace(old, new): v for k, v in t.items()}, str(f))
    elif case == "shape":          # trained on a model half as wide
        other = ModelConfig.from_dict(dict(cfg.raw, hidden_size=cfg.hidden_size // 2))
        make_adapter(folder, other, seed=3)
    else:
        make_adapter(folder, cfg, seed=3)
        (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=message):
        read_peft(folder, cfg)


# ----------------------------------------------------------------------------- hybrid4 on gloo, and serving
def test_hybrid4_adapter_equals_merged_and_loads_at_run_time(served, base, tiny_dir, adapters, cfg, tmp_path):
    """Four gloo ranks (AR TP4, denoise TP2 x SP2; each rank holds its slices of A/B): the adapter loaded at
    start gives the merged checkpoint's text and image, no adapter the base model's; adapters loaded while
    the engine runs (one of the MLPs too: its experts' slices per rank) serve at once as on tp1 and, unloaded,
    are refused by name."""
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    merged = alone(load(merged_checkpoint(tiny_dir, tmp_path / "merged", adapters["plain"], cfg)))
    with EngineServer(EngineConfig(tiny_dir, plan="hybrid4", preview_every=0, loras=[("plain", adapters["plain"])],
                      max_loras=3, lora_mlp=True)) as server:
        assert server.wait_ready(300), server.health()
        got = outcome(list(server.stream(Request(**(REQUEST | dict(lora="plain"))))))
        none = outcome(list(server.stream(Request(**REQUEST))))
        server.load_adapter("patterned", adapters["patterned"])
        server.load_adapter("mlp", adapters["mlp"])
        assert server.adapters() == ["plain", "patterned", "mlp"]
        late = outcome(list(server.stream(Request(**(REQUEST | dict(lora="patterned", lora_scale=0.5))))))
        mlp = outcome(list(server.stream(Request(**(REQUEST | dict(lora="mlp"))))))
        server.unload_adapter("patterned")
        refused = list(server.stream(Request(**(REQUEST | dict(lora="patterned")))))
    assert got[0] == merged[0] and psnr(got[1], merged[1]) >= 40
    assert none[0] == base[0] and psnr(none[1], base[1]) >= 40
    want = alone(served, lora="patterned", lora_scale=0.5)
    assert late[0] == want[0] and psnr(late[1], want[1]) >= 40
    want = alone(served, lora="mlp")                   # tp1's unmerged MLP adapter: the merged checkpoint's output
    assert mlp[0] == want[0] and psnr(mlp[1], want[1]) >= 40
    assert [(e.kind, e.param) for e in refused] == [("invalid", "lora")] and "unknown LoRA adapter" in refused[0].message


def test_readme_serves_a_peft_adapter_to_the_openai_client(tmp_path, monkeypatch):
    """The README's *LoRA adapters* commands and Python, as written (the port aside), on the embedded model:
    the adapter is listed and chosen by name; the load / unload routes need the key, and a model that is not
    served is a 404 naming what is."""
    import re
    import subprocess
    import sys
    import time

    import httpx
    openai = pytest.importorskip("openai")
    from engine.parallel.groups import free_port
    root = Path(__file__).resolve().parents[1]
    section = (root / "README.md").read_text().split("## LoRA adapters", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "assets").symlink_to(root / "assets")
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "STUDIO_API_KEY": "", "GRADIO_ANALYTICS_ENABLED": "False"}
    make, serve = (line.split("#")[0].split() for line in shell)
    assert make[:3] == ["python", "-m", "tools.tiny_lora"] and serve[:2] == ["python", "app.py"]
    subprocess.run([sys.executable, *make[1:]], cwd=tmp_path, env=env, check=True, timeout=300)
    port = free_port()
    log = (tmp_path / "app.log").open("w")
    proc = subprocess.Popen([sys.executable, str(root / "app.py"), *serve[2:], "--port", str(port)], cwd=tmp_path,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "app.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        monkeypatch.chdir(tmp_path)                   # where the README's commands ran
        exec(compile(code.replace("127.0.0.1:7860", f"127.0.0.1:{port}"), "README.md", "exec"), {"__name__": "readme"})
        assert PILImage.open(tmp_path / "styled.png").size == (256, 256)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-local", max_retries=0)
        assert [m.id for m in client.models.list()][1:] == ["my-style"]
        with pytest.raises(openai.NotFoundError, match="does not exist; this server serves .* and the LoRA adapters 'my-style'"):
            client.images.generate(model="other", prompt="a cat", size="256x256")
        with pytest.raises(openai.BadRequestError, match="lora_scale.*applies only with `model` naming a LoRA adapter"):
            client.images.generate(prompt="a cat", size="256x256", extra_body={"lora_scale": 0.5})
        anonymous = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "my-style"}, timeout=10)
        assert anonymous.status_code == 401
        keyed = dict(headers={"Authorization": "Bearer sk-local"}, timeout=60)
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "my-style"}, **keyed).status_code == 200
        assert [m.id for m in client.models.list()][1:] == []
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "assets")}, **keyed)
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
        ok = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": "my-style-lora"}, **keyed)
        assert ok.status_code == 200 and [m.id for m in client.models.list()][1:] == ["again"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_serve_adapters_per_row(tiny_dir):
    """CUDA bf16, every prefill, decode and denoise step a graph replay reading the adapter slots from static
    buffers (a graph per LoRA mode: none, one adapter, each row its own): no adapter, one and the other
    decoded and denoised together (one denoise batch) each give their solo run, the adapter changes the
    image, and an adapter loaded after the graphs were captured is served by the same graphs."""
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    tables = lm.model.enable_lora(capacity=3, max_rank=8)
    made = {"plain": random_adapter(lm.cfg, 8, seed=1), "patterned": random_adapter(lm.cfg, 4, seed=2)}
    for name, adapter in made.items():       # in memory: the GPU machine need not have peft
        tables.install(name, adapter)
    one = REQUEST | dict(size="256x256")     # one bucket: one denoise batch
    kws = [one, one | dict(lora="plain"), one | dict(lora="patterned", lora_scale=0.5)]
    pipe = make_engine(lm, preview_every=0, max_batch=len(kws), max_denoise_batch=len(kws))
    assert pipe.ctx.cuda_graph
    solo = [outcome(list(pipe.run(Request(**kw)))) for kw in kws]
    events, scheduler = run_together(lm, kws, engine=pipe)
    for i in range(len(kws)):
        got = outcome(events[i])
        assert got[0] == solo[i][0] and psnr(got[1], solo[i][1]) >= 35, i
    assert differs(solo[1], solo[0]) and differs(solo[2], solo[0])
    assert scheduler.denoising.member_steps > scheduler.denoising.forwards        # denoise steps were shared
    modes = {p for k in pipe.graphs.captures for p in k if isinstance(p, tuple) and p[:1] == ("lora",)}
    assert modes == {("lora", "one"), ("lora", "rows")}, pipe.graphs.captures
    captures = sum(pipe.graphs.captures.values())
    assert captures > 0
    tables.remove("patterned")
    tables.install("again", made["patterned"])
    again = outcome(list(pipe.run(Request(**(kws[2] | dict(lora="again"))))))
    assert again[0] == solo[2][0] and psnr(again[1], solo[2][1]) >= 35
    assert sum(pipe.graphs.captures.values()) == captures          # no new capture for the new adapter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_serve_an_mlp_adapter_per_row(tiny_dir):
    """CUDA bf16 with MLP tables: an adapter of the MLPs too, one of the attention projections and none, decoded
    and denoised together (graphs of modes "rows+mlp", and "one+mlp" for the MLP adapter alone): each gives its
    solo run and the MLP adapter changes the image."""
    lm = load(tiny_dir, "cuda", torch.bfloat16)
    tables = lm.model.enable_lora(capacity=2, max_rank=8, mlp=True)
    tables.install("plain", random_adapter(lm.cfg, 8, seed=1))
    tables.install("mlp", random_adapter(lm.cfg, 8, seed=3, mlp=True))
    one = REQUEST | dict(size="256x256")
    kws = [one, one | dict(lora="mlp"), one | dict(lora="plain", lora_scale=0.5)]
    pipe = make_engine(lm, preview_every=0, max_batch=len(kws), max_denoise_batch=len(kws))
    solo = [outcome(list(pipe.run(Request(**kw)))) for kw in kws]
    events, scheduler = run_together(lm, kws, engine=pipe)
    for i in range(len(kws)):
        got = outcome(events[i])
        assert got[0] == solo[i][0] and psnr(got[1], solo[i][1]) >= 35, i
    assert differs(solo[1], solo[0])
    assert scheduler.denoising.member_steps > scheduler.denoising.forwards
    modes = {p for k in pipe.graphs.captures for p in k if isinstance(p, tuple) and p[:1] == ("lora",)}
    assert {("lora", "one+mlp"), ("lora", "rows+mlp")} <= modes, pipe.graphs.captures


def test_studio_picker_sends_the_adapter_and_puts_its_errors_on_the_controls(tiny_dir, tmp_path):
    """The page's adapter picker and strength slider become the request's lora / lora_scale ("none" the base
    model); a wrong value's message lands on the control that holds it."""
    import dataclasses

    from engine.serve.info import ModelInfo
    from webui.options import NO_LORA, Settings, build_request
    from webui.studio import Studio

    class Client:                      # what the studio asks of the engine server here
        def adapters(self) -> list[str]:
            return ["plain"]

    info = ModelInfo.from_folder(tiny_dir)
    studio = Studio(Client(), info, tmp_path)
    s = Settings("image", "auto", 1, False, 2, 5.0, info.presets[0], "", 8, "none", "plain", 0.5)
    assert (build_request("a cat", [], s).lora, build_request("a cat", [], s).lora_scale) == ("plain", 0.5)
    assert build_request("a cat", [], dataclasses.replace(s, lora=NO_LORA)).lora is None
    controls = ("prompt", *Settings.NAMES)
    assert studio.validation("a cat", None, s, controls) == {}
    gone = studio.validation("a cat", None, dataclasses.replace(s, lora="gone"), controls)
    assert gone == {"lora": "Unknown LoRA adapter 'gone'; the loaded ones are plain"}
    strong = studio.validation("a cat", None, dataclasses.replace(s, lora_scale=9), controls)
    assert strong == {"lora_scale": "The LoRA strength (lora_scale) must be a number in (0, 4] (got 9)"}
    picker, slider = studio.adapter_picker()
    assert picker["choices"] == [NO_LORA, "plain"] and picker["visible"] and slider["visible"]


def test_studio_on_a_merged_engine_offers_only_the_merged_adapter(tiny_dir, tmp_path):
    """--lora-merged: the engine serves its one adapter at strength 1 and refuses the base model, so the page
    shows that adapter chosen and fixed, with no strength slider, and the form's check refuses the base model
    as the engine would (EngineServer.merged_adapter: test_server_serves_a_merged_adapter)."""
    import dataclasses

    from engine.serve.info import ModelInfo
    from webui.options import NO_LORA, Settings
    from webui.studio import Studio, build_studio

    class Client:                      # what the studio asks of a merged engine server
        def adapters(self) -> list[str]:
            return ["plain"]

        def merged_adapter(self) -> str | None:
            return "plain"

    info = ModelInfo.from_folder(tiny_dir)
    studio = Studio(Client(), info, tmp_path)
    picker, slider = studio.adapter_picker()
    assert picker["choices"] == ["plain"] and picker["value"] == "plain" and picker["interactive"] is False
    assert slider["visible"] is False and slider["value"] == 1.0
    demo = build_studio(Client(), info, out_dir=tmp_path)
    (lora,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "lora"]
    assert lora.value == "plain" and not lora.interactive and [c[1] for c in lora.choices] == ["plain"]
    controls = ("prompt", *Settings.NAMES)
    s = Settings("image", "auto", 1, False, 2, 5.0, info.presets[0], "", 8, "none", lora.value, 1.0)
    assert studio.validation("a cat", None, s, controls) == {}
    assert "must name it" in studio.validation("a cat", None, dataclasses.replace(s, lora=NO_LORA), controls)["lora"]


@pytest.mark.parametrize("targets", [["qkv_proj", "o_proj"], MLP_TARGETS])
def test_adapter_on_quantized_resident_weights(tmp_path, targets):
    """Base weights kept quantized (MXFP8 packs, the CUDA layout, here through the reference ops): the adapter's
    product is added to the quantized projection's output, and inside the quantized experts (`moe_lora` on the
    packs' grouped GEMMs), giving what it gives on the dequantized weights."""
    from tools.tiny import make_tiny
    folder = make_tiny(tmp_path / "mxfp8", blocks=True, quant="mxfp8")
    runs = {}
    for resident in ("quantized", "dense"):
        lm = load(folder, resident=resident)
        tables = lm.model.enable_lora(capacity=1, max_rank=8, mlp=len(targets) > 2)
        load_adapter(tables, "plain", make_adapter(tmp_path / "adapter", lm.cfg, seed=1, target_modules=targets))
        runs[resident] = alone(lm, lora="plain")
        if resident == "quantized":
            base = alone(lm)
    assert runs["quantized"][0] == runs["dense"][0] and psnr(runs["quantized"][1], runs["dense"][1]) >= 40
    assert differs(runs["quantized"], base)


def test_each_rank_reads_its_slice(adapters, cfg):
    """A hybrid4 rank (storage shard 1 of 2, two micros) reads qkv_proj's lora_B rows and o_proj's lora_A
    columns of its shard only, as its base weights are split; A of qkv_proj and B of o_proj whole."""
    from engine.parallel.plan import get_plan
    layout = get_plan("hybrid4").layout(3)
    whole, mine = read_peft(adapters["plain"], cfg), read_peft(adapters["plain"], cfg, layout)
    assert layout.storage_size == 2 and layout.storage_rank == 1
    n = names.layer(1)
    qkv, o = whole.layers[n.qkv_proj], whole.layers[n.o_proj]
    rows, cols = qkv.b.shape[0] // 2, o.a.shape[1] // 2
    assert torch.equal(mine.layers[n.qkv_proj].b, qkv.b[rows:]) and torch.equal(mine.layers[n.qkv_proj].a, qkv.a)
    assert torch.equal(mine.layers[n.o_proj].a, o.a[:, cols:]) and torch.equal(mine.layers[n.o_proj].b, o.b)


def test_command_line_refuses_a_scale_without_adapter_and_a_bad_folder(tiny_dir, tmp_path, capsys, adapters):
    """Refused: a strength or --lora-merged without an adapter, a folder that is not one; --lora-merged with an
    adapter generates (the adapter folded into the weights at --lora-scale)."""
    from engine.__main__ import main
    common = ["generate", "--model", str(tiny_dir), "--prompt", "a cat", "--steps", "1", "--out", str(tmp_path / "o.png")]
    assert main(common + ["--lora-scale", "2"]) == 2
    assert "--lora-scale needs --lora PATH" in capsys.readouterr().err
    assert main(common + ["--lora-merged"]) == 2
    assert "--lora-merged needs --lora PATH" in capsys.readouterr().err
    assert main(common + ["--lora", str(adapters["plain"]), "--lora-scale", "0.5", "--lora-merged"]) == 0
    assert PILImage.open(tmp_path / "o.png").width > 0
    (tmp_path / "o.png").unlink()
    assert main(common + ["--lora", str(adapters["mlp"])]) == 0          # an adapter of the MLPs, unmerged
    assert PILImage.open(tmp_path / "o.png").width > 0
    assert main(common + ["--lora", str(tiny_dir)]) == 2
    assert f"LoRA adapter {tiny_dir}: no adapter_config.json" in capsys.readouterr().err
