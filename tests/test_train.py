"""CPU tests of the embedded model's training code: the procedural dataset (determinism, held-out
split, CoT format), the tokenizer, the detector on clean renders, training sequences equal to the
inference sequences, and a toy-scale train step that lowers the loss and writes a folder the engine
loads and runs."""
from __future__ import annotations


import pytest
import torch

from engine import EMBEDDED_MODEL
from engine.runtime.events import Image, Ratio
from engine.model.loader import load
from engine.model.hunyuan import HunyuanImage3
from engine.checkpoint.config import ModelConfig
from engine.runtime.request import Request
from engine.runtime.sequence import text_phase_sequence, user_turn
from engine.checkpoint.tokenizer import OFFICIAL_SPECIAL_TOKENS
from train.dataset import FORMATS, GROUP_TASKS, edit_chain, is_heldout, make_sample, system_text
from train.detect import detect
from train.evaluate import check_edit, check_t2i, parse_recaption, well_formed
from train.tokenizer import build_tokenizer, padded_vocab, save_and_load
from engine_drive import make_engine

EMBEDDED = EMBEDDED_MODEL


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    hf = build_tokenizer(n_texts=800)
    return hf, save_and_load(hf, tmp_path_factory.mktemp("tok"))


def test_dataset_is_deterministic_and_split_by_spec():
    for group in (0, 1, 2, 3):
        a, b = make_sample(7, "train", group=group), make_sample(7, "train", group=group)
        assert (a.prompt, a.think, a.recaption, a.target, a.refs) == (b.prompt, b.think, b.recaption, b.target, b.refs)
        assert a.refs == () if group == 0 else len(a.refs) == group
        assert a.task in GROUP_TASKS[group]
    assert make_sample(1, "train").prompt != make_sample(2, "train").prompt or \
        make_sample(1, "train").target != make_sample(2, "train").target
    train = [make_sample(i, "train") for i in range(150)]
    test = [make_sample(i, "test") for i in range(60)]
    assert not any(is_heldout(s.key) for s in train) and all(is_heldout(s.key) for s in test)
    assert not {s.key for s in train} & {s.key for s in test}
    assert {s.bot_task for s in test} == {"think_recaption"} and {s.system for s in test} == {"en_unified"}
    assert {s.bot_task for s in train} == {"think_recaption", "recaption", "image"}


def test_an_edit_chain_edits_the_scene_the_turn_before_should_have_made():
    for seed in range(40):
        chain = edit_chain(seed)
        assert len(chain) == 3 and chain[0] == make_sample(seed, "test", group=1)
        for before, after in zip(chain, chain[1:]):
            assert after.refs == (before.target,) and after.task in GROUP_TASKS[1]
            assert after.target != before.target        # every turn asks for a change
        # and the checks hold on a perfect rendering of each target
        for s in chain:
            assert check_edit(s.task, s.check, detect(s.target.render()))[0], (seed, s.task, s.prompt)
    assert edit_chain(3) == edit_chain(3)


def test_cot_format_and_recaption_describes_the_target(tokenizers):
    _, tok = tokenizers
    for i in range(80):
        s = make_sample(i, "test", group=i % 4)
        cot = s.cot_text()
        assert cot.startswith("<think>") and "</think><recaption>" in cot and cot.endswith("</recaption>")
        assert len(tok.encode(cot)) <= 64
        parsed = parse_recaption(s.recaption)
        assert parsed["format"] == s.target.fmt and parsed["background"] == s.target.background
        assert sorted(parsed["objects"]) == sorted((o.color, o.shape, o.cell) for o in s.target.objects)
        assert s.bucket.index == FORMATS[s.target.fmt]


def test_tokenizer_has_every_official_special_token(tokenizers):
    hf, tok = tokenizers
    for name in OFFICIAL_SPECIAL_TOKENS:
        assert tok.encode(name) == [tok.token_id(name)]
    assert padded_vocab(hf) % 64 == 0 and padded_vocab(hf) >= tok.vocab_size
    assert tok.decode(tok.encode("two small red stars on the left")) == "two small red stars on the left"


def test_detector_reads_clean_renders_exactly():
    n = 0
    for i in range(40):
        s = make_sample(i, "train", group=i % 4)
        for scene in (s.target, *s.refs):
            d = detect(scene.render())
            assert d.background == scene.background
            assert sorted((o.color, o.shape, o.cell) for o in d.objects) == \
                sorted((o.color, o.shape, o.cell) for o in scene.objects), (scene, d.objects)
            n += 1
    assert n > 60
    s = make_sample(3, "test", group=0)
    assert all(all(v) for v in check_t2i(s.check, detect(s.target.render())).values())
    for i in range(16):
        e = make_sample(i, "test", group=1 + i % 3)
        assert check_edit(e.task, e.check, detect(e.target.render())) == (True, True), e.task


def test_training_sequence_is_the_inference_sequence(tokenizers):
    from train.train import TrainSequence
    _, tok = tokenizers
    cfg = ModelConfig.from_dict(_small_cfg(tokenizers[0]))
    sp = tok.special
    for group in (0, 1, 3):
        s = make_sample(5, "test", group=group)
        ts = TrainSequence(tok, cfg, s)
        # the AR prompt the pipeline builds, then the CoT ids it would generate, are the sequence's head
        layouts = [c for c in _layouts(ts, s)]
        ar = text_phase_sequence(user_turn(tok, system_text(s.system), s.prompt, layouts), "think", cfg.image_base_size)
        assert ts.ids[:len(ar)] == ar.ids and ts.targets[0] == len(ar)
        gen = ts.ids[len(ar):ts.span.meta_start]
        assert well_formed(gen, sp) and gen[-1] == sp.ratio[s.bucket.index]
        assert ts.ids[ts.span.meta_start:ts.span.start] == [sp.timestep, sp.guidance, sp.timestep_r]


def _layouts(ts, s):
    from engine.runtime.sequence import CondImageLayout
    return [CondImageLayout((sc.bucket.height // 16, sc.bucket.width // 16), sc.bucket.index, v.spatial_shapes,
                            v.pixel_values.shape[0]) for sc, v in zip(s.refs, ts.vit)]


def _small_cfg(hf):
    """The embedded model's config with test-sized dimensions (same structure)."""
    from train.config import model_config
    cfg = model_config(padded_vocab(hf))
    L = 2
    cfg |= {"hidden_size": 64, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
            "attention_head_dim": 16, "head_dim": 16, "moe_intermediate_size": [32] * L, "moe_topk": [2] * L,
            "num_experts": 4, "num_shared_expert": [1] * L, "patch_embed_hidden_dim": 32,
            "vit_aligner": dict(cfg["vit_aligner"], n_embed=64)}
    cfg["vae"] = dict(cfg["vae"], block_out_channels=[32] * 5)
    return cfg


def test_toy_train_step_lowers_the_loss_and_writes_a_loadable_model(tokenizers, tmp_path):
    from train.config import write_folder
    from train.train import RouterAux, SeqBatches, export_tensors, init_weights, transformer_losses
    hf, tok = tokenizers
    torch.manual_seed(0)
    cfg = _small_cfg(hf)
    model = HunyuanImage3(ModelConfig.from_dict(cfg), dtype=torch.float32)
    init_weights(model, 0)
    model.vae.scaling_factor = 1.0
    params = [p for n, p in model.named_parameters() if not n.startswith("vae.")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=3e-3)
    ds = SeqBatches(str(tmp_path / "tok.json"), cfg, 0, scale=0.03)
    hf.save(str(tmp_path / "tok.json"))
    batches = [ds[i] for i in range(6)]
    assert {len(b["ref"]) > 0 for b in batches} == {True, False}        # T2I and TI2I batches
    aux = RouterAux(model)

    def loss_of(b):
        L = transformer_losses(model, b, torch.device("cpu"), aux)
        return L["ce"] + L["fm"] + 0.01 * L["aux"]

    with torch.no_grad():
        before = sum(float(loss_of(b)) for b in batches)
    for _ in range(4):
        for b in batches:
            opt.zero_grad()
            loss_of(b).backward()
            opt.step()
    with torch.no_grad():
        after = sum(float(loss_of(b)) for b in batches)
    print(f"toy loss {before:.3f} -> {after:.3f}")
    assert after < 0.8 * before, (before, after)
    for h in aux.handles:
        h.remove()

    folder = write_folder(tmp_path / "model", hf, cfg, export_tensors(model))
    lm = load(folder)
    ref = {n: p.detach() for n, p in model.named_parameters()}
    for n, p in lm.model.named_parameters():
        torch.testing.assert_close(p, ref[n].to(torch.bfloat16).to(p.dtype) if p.dtype != ref[n].dtype
                                   else ref[n], atol=1e-2, rtol=1e-2)
    s = make_sample(0, "test", group=1)
    events = list(make_engine(lm, preview_every=0).run(Request(prompt=s.prompt, images=[s.refs[0].render()], seed=1,
                                                           steps=2, max_new_tokens=6)))
    assert any(isinstance(e, Ratio) for e in events)
    img = [e for e in events if isinstance(e, Image)]
    assert img and (img[0].height, img[0].width) in {(b.height, b.width) for b in lm.buckets}


def test_latent_targets_are_the_quadrant_colours():
    from train.train import latent_targets
    x = torch.full((1, 3, 32, 48), -1.0)
    x[:, 0, :8, :8] = 1.0                     # red top-left quadrant of the first token only
    t = latent_targets(x, 16)
    assert t.shape == (1, 12, 2, 3)
    # channel = colour * 4 + quadrant (pixel_unshuffle order: row-major quadrants)
    assert t[0, 0, 0, 0] == 1.0 and t[0, 1:4, 0, 0].eq(-1).all() and t[0, 4:, 0, 0].eq(-1).all()
    assert t[0, :, 1:, :].eq(-1).all() and t[0, :, :, 1:].eq(-1).all()


def test_foreground_weights_favour_shape_tokens():
    from train.dataset import Obj, Scene
    from train.train import _uint8, foreground_weights
    empty = _uint8(Scene("square", "white", ()).render())[None]
    one = _uint8(Scene("square", "white", (Obj("circle", "red", "large", (0, 0)),)).render())[None]
    w0 = foreground_weights(empty, torch.device("cpu"), 16, 4.0)
    w1 = foreground_weights(one, torch.device("cpu"), 16, 4.0)
    assert torch.allclose(w0, torch.ones_like(w0))
    assert abs(float(w1.mean()) - 1.0) < 1e-5
    assert float(w1[0, 0, :5, :5].max()) > 2.0 * float(w1[0, 0, -5:, -5:].max())   # circle top left


@pytest.mark.skipif(not (EMBEDDED / "config.json").exists(), reason="no embedded model in assets/")
def test_training_forward_is_the_inference_forward(monkeypatch):
    """The velocity the trainer fits is the one the pipeline computes for the same sample (its CoT
    forced, the same x_t): same sequence, system prompt, positions, mask, reference-image and timestep
    embeddings. A TI2I sample with two references, on the trained embedded model (a random model's
    image tokens barely depend on the text, so it would not catch a different prefix)."""
    import engine.runtime.program as P
    from engine.runtime.denoise import StepInputs, flow_sigmas
    from engine.runtime.text_phase import TextResult
    from train.train import TrainSequence, _uint8, collate, gen_velocity, sequence_hidden
    lm = load(EMBEDDED, "cpu", torch.float32)
    model, tok = lm.model, lm.tok
    # one posterior for both sides (the trainer and the pipeline draw different posterior noise)
    monkeypatch.setattr(model.vae, "encode_latent",
                        lambda px, gen: model.vae.encode_moments(px)[0].squeeze(2) * model.vae.scaling_factor)

    s = make_sample(3, "test", group=2)
    ts = TrainSequence(tok, model.cfg, s)
    ts.target_image = _uint8(s.target.render())
    batch = collate([ts], tok.special.pad)
    (h, w), g = next(iter(batch["gen"].items()))
    x = torch.randn(1, int(model.cfg.vae["latent_channels"]), h, w, generator=torch.Generator().manual_seed(1))
    sig = flow_sigmas(4, 3.0)
    t, r = sig[1:2] * 1000.0, sig[2:3]
    guid = torch.tensor([1000.0 * lm.gen.diff_guidance_scale]).to(torch.bfloat16).float()
    with torch.no_grad():
        hid = sequence_hidden(model, batch, torch.device("cpu"), {(h, w): (x, t, r, guid)})
        v_train = gen_velocity(model, hid, g, h, w, t, torch.device("cpu"))

    generated = ts.ids[ts.targets[0]:ts.span.meta_start]            # the CoT ids and the ratio token

    def forced_text(*args, **kw):              # the text phase's protocol: no decode step, then the result
        yield from ()
        return TextResult(tokens=list(generated), ratio_token=generated[-1], fed=0)

    got = {}

    class FirstStepAtTheTrainingInputs(P.FlowSampler):     # step 0's velocity at the inputs above, kept
        def inputs(self, i):
            return StepInputs(x, t, r * 1000.0, guid) if i == 0 else super().inputs(i)

        def update(self, i, v):
            got.setdefault("v", v.clone())
            return super().update(i, v)

    monkeypatch.setattr(P, "generate_text", forced_text)
    monkeypatch.setattr(P, "FlowSampler", FirstStepAtTheTrainingInputs)
    list(make_engine(lm, preview_every=0, kv_handoff=False).run(
        Request(prompt=s.prompt, images=[sc.render() for sc in s.refs], seed=1, steps=4)))
    assert got["v"].shape == v_train.shape
    torch.testing.assert_close(got["v"], v_train, atol=1e-4, rtol=1e-4)
