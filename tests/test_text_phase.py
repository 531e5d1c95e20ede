"""The AR phase: KV-cached decode equals recompute, determinism, seeded sampling, the official stage
machine (scripted logits), 2D positions and the generalised causal mask."""
from __future__ import annotations

import pytest
import torch

from engine.model.attention import KVCache, attention_mask
from engine.runtime.events import Done, Text
from engine.parallel.layout import PhaseView
from engine.runtime.request import Request
from engine.runtime.sampling import SamplingParams, choose
from engine.runtime.sequence import SequenceBuilder, text_phase_sequence, user_turn
from engine.runtime.text_phase import StagePlan, TextResult, generate_text

from engine_drive import drive, make_engine, run_backbone


def _cache(lm, n):
    c = lm.cfg
    return KVCache.allocate(c.num_layers, 1, c.num_kv_heads, n, c.head_dim, lm.model.dtype, "cpu")


def test_cached_decode_equals_full_recompute(tiny):
    model, tok = tiny.model, tiny.tok
    seq = text_phase_sequence(user_turn(tok, "", "a big red star on the left", []), "think", 256)
    L, steps = len(seq), 6
    T = seq.tensors(length=L + steps)
    ids = T["ids"].tolist()
    cache = _cache(tiny, L + steps)
    view = PhaseView()
    with torch.no_grad():
        h = run_backbone(model, model.transformer.embed(T["ids"][None]), torch.arange(L), T["pos"], T["blocks"], cache,
                         L, view)
        cached = [model.transformer.logits(h[:, -1], view)[0]]
        for s in range(steps):
            ids.append(int(cached[-1].argmax()))
            x = model.transformer.embed(torch.tensor([[ids[-1]]]))
            h = run_backbone(model, x, torch.tensor([L + s]), T["pos"], T["blocks"], cache, L + s + 1, view,
                             masked=False)
            cached.append(model.transformer.logits(h[:, -1], view)[0])
        for s in range(steps + 1):
            n = L + s
            fresh = _cache(tiny, n)
            h = run_backbone(model, model.transformer.embed(torch.tensor([ids[:n]])), torch.arange(n), T["pos"],
                             T["blocks"], fresh, n, view)
            full = model.transformer.logits(h[:, -1], view)[0]
            assert (full - cached[s]).abs().max().item() <= 1e-5, s


def _text(pipe, **kw):
    out, done = [], None
    for ev in pipe.run(Request(prompt="two small blue circles", text_only=True, max_new_tokens=12, **kw)):
        if isinstance(ev, Text):
            out.append(ev.delta)
        elif isinstance(ev, Done):
            done = ev
    return done.cot_text, "".join(out)


def test_greedy_is_deterministic_and_seeded_sampling_reproduces(tiny):
    pipe = make_engine(tiny)
    assert _text(pipe, greedy=True, seed=1) == _text(pipe, greedy=True, seed=2)
    a, b, c = _text(pipe, seed=5), _text(pipe, seed=5), _text(pipe, seed=6)
    assert a == b and a != c


class ScriptedRow:
    """Stands in for a request's AR row: forward k (the prefill, a decode step, a forward of fed tokens)
    returns logits script[k] ({token: logit}, others 0) — a scripted logits source for the stage machine;
    `fed` records every id fed after the prompt."""
    slot = 0

    def __init__(self, script, vocab, length):
        self.script, self.vocab, self.length, self.calls = list(script), vocab, length, 0
        self.fed: list[int] = []

    def _logits(self):
        logits = torch.zeros(self.vocab)
        step = self.script[self.calls] if self.calls < len(self.script) else {}
        for t, v in (step.items() if isinstance(step, dict) else [(step, 10.0)]):
            logits[t] = v
        self.calls += 1
        return logits

    def prefill(self, embeds):
        return self._logits()

    def feed(self, ids, start):
        self.fed += list(ids)
        return self._logits()

    def decode(self, need, vocab):
        """A Decode need answered as the engine's decode step does (the padded vocabulary masked)."""
        self.fed.append(need.token)
        logits = self._logits()
        logits[vocab:] = float("-inf")
        return int(choose(logits, need.params, need.generator, need.allowed))


def _run_plan(tiny, script, task, need_ratio, max_new=40):
    tok = tiny.tok
    plan = StagePlan.for_task(task, need_ratio, tok.special)
    L = 5
    fake = ScriptedRow(script, tiny.cfg.vocab_size, L + max_new + 8)
    _, res = drive(generate_text(tok, fake, torch.zeros(1, L, 4), plan, SamplingParams(greedy=True), None, max_new),
                   lambda need: fake.decode(need, tok.vocab_size))
    return res, fake


def test_stage_machine_think_recaption_auto_size(tiny):
    sp = tiny.tok.special
    word = tiny.tok.encode("red")[0]
    # <recaption> is forced after </think>; after </recaption> the answer prefix is forced (no logits are
    # consumed for forced tokens); the ratio is the best ratio token even though `word` scores higher.
    script = [word, sp.eos, sp.end_think, word, word, sp.end_recaption,
              {word: 50.0, sp.ratio[5]: 3.0, sp.ratio[30]: 2.0}]
    res, fake = _run_plan(tiny, script, "think_recaption", True)
    assert isinstance(res, TextResult)
    t = res.tokens
    assert t[:4] == [word, sp.eos, sp.end_think, sp.recaption]          # eos does not stop a CoT task
    i = t.index(sp.end_recaption)
    assert t[i + 1:i + 4] == [sp.answer, sp.boi, sp.size]
    assert t[-1] == res.ratio_token == sp.ratio[5]                      # greedy within the ratio slice
    assert t.count(sp.recaption) == 1                                    # each transition fires once
    assert sp.ratio[-1] not in fake.fed[-1:]                             # the ratio token is never fed


def test_stage_machine_fixed_size_and_think_only(tiny):
    sp = tiny.tok.special
    word = tiny.tok.encode("red")[0]
    res, _ = _run_plan(tiny, [word, sp.end_think, word, sp.end_recaption, word], "think_recaption", False)
    assert res.tokens[-1] == sp.end_recaption and res.ratio_token is None
    res, _ = _run_plan(tiny, [word, word, sp.end_think, word], "think", False)
    assert res.tokens == [word, word, sp.end_think]
    res, _ = _run_plan(tiny, [word, sp.end_think, word, sp.eos, word], "auto", False)
    assert res.tokens[-1] == sp.eos and sp.recaption not in res.tokens


def test_budget_exhaustion_still_chooses_a_ratio(tiny):
    sp = tiny.tok.special
    word = tiny.tok.encode("red")[0]
    res, _ = _run_plan(tiny, [word] * 30, "think_recaption", True, max_new=6)
    assert res.ratio_token in sp.ratio
    assert res.tokens[-4:-1] == [sp.answer, sp.boi, sp.size]


def test_ratio_pass_without_cot(tiny):
    sp = tiny.tok.special
    res, _ = _run_plan(tiny, [{sp.eos: 9.0, sp.ratio[33]: 1.0}], "image", True)
    assert res.tokens == [sp.ratio[33]] and res.ratio_token == sp.ratio[33]


def test_2d_positions_worked_example(tiny):
    b = SequenceBuilder(tiny.tok)
    for _ in range(96):
        b.token(tiny.tok.special.pad)
    seq = b.gen_image(45, 80, 0, distil=False).build()
    assert seq.gen_image.start == 100
    assert seq.pos[100] == (1877, 1860)
    assert seq.pos[100 + 79] == (1877, 1860 + 79) and seq.pos[100 + 80] == (1878, 1860)
    assert seq.pos[3700] == (3700, 3700) and seq.ids[3700] == tiny.tok.special.eoi


def test_mask_is_causal_plus_full_blocks():
    blocks = torch.tensor([-1, -1, 0, 0, 0, -1, 1, 1, -1])
    m = attention_mask(torch.arange(9), blocks, 9)
    for i in range(9):
        for j in range(9):
            same = blocks[i] >= 0 and blocks[i] == blocks[j]
            assert m[i, j].item() == (j <= i or bool(same)), (i, j)
    # queries that are a tail of the sequence see the same rows
    assert torch.equal(attention_mask(torch.arange(4, 9), blocks, 9), m[4:])


def test_batched_decode_rows_equal_the_plain_forward_of_each_row(tiny):
    """The batched decode step (static buffers, device lengths, each row its own sequence: its prompt, its
    2D positions, its length) gives each row the logits of that row's plain forward over its cache up
    to the token, whatever the other rows hold, idle rows included (slot 2 of the bucket of 4)."""
    from engine.runtime.decode_step import DecodeStep
    from engine.runtime.graphs import Graphs
    from engine.runtime.sequence import CondImageLayout
    model, tok, c = tiny.model, tiny.tok, tiny.cfg
    view = PhaseView()
    image = CondImageLayout((4, 6), 0, (2, 3), 6)           # a reference image: 2D positions, a full block
    seqs = {0: text_phase_sequence(user_turn(tok, "", "a small green triangle", []), "think", 256),
            1: text_phase_sequence(user_turn(tok, "", "two red circles over a long blue line", [image]), "think", 256),
            3: text_phase_sequence(user_turn(tok, "", "a star", []), "recaption", 256)}
    n = max(len(q) for q in seqs.values()) + 9
    slots = KVCache.allocate(c.num_layers, 4, c.num_kv_heads, n, c.head_dim, model.dtype, "cpu")
    pos = torch.zeros(4, n, 2, dtype=torch.long)
    step = DecodeStep(model, slots, pos, view, Graphs(), ())
    alone, T = {}, {}
    words = tok.encode(" red circle on blue")
    with torch.no_grad():
        for s, q in seqs.items():
            T[s] = q.tensors(length=n - 1)
            pos[s, :n - 1] = T[s]["pos"]
            L = len(q)
            emb = model.transformer.embed(T[s]["ids"][None])   # image slots embedded as their ids: any values do
            alone[s] = _cache(tiny, n)
            for cache in (alone[s], slots.rows(slice(s, s + 1))):
                run_backbone(model, emb, torch.arange(L), T[s]["pos"], T[s]["blocks"], cache, L, view)
        for k, t in enumerate(words):
            rows = [(s, t + s, len(q) + k) for s, q in seqs.items()]       # each row its own token and index
            batched = step(rows)
            assert batched.shape[0] == 4 and step.bucket([0, 1, 3]) == 4
            for s, token, index in rows:
                x = model.transformer.embed(torch.tensor([[token]]))
                h = run_backbone(model, x, torch.tensor([index]), T[s]["pos"], T[s]["blocks"], alone[s], index + 1,
                                 view, masked=False)
                plain = model.transformer.logits(h[:, -1], view)[0]
                assert (batched[s] - plain).abs().max().item() <= 1e-5, (s, k)
    assert step.forwards == len(words)


def test_per_token_time_counts_sampled_tokens_only(tiny):
    """The forced tokens (<recaption>, then <answer> <boi> <img_size>) cost no decode step of their own:
    ms/token is the decode time over the sampled tokens after the first, and the timing line says so."""
    from engine.runtime.events import Timings
    sp = tiny.tok.special
    word = tiny.tok.encode("red")[0]
    script = [word, sp.end_think, word, word, sp.end_recaption, {sp.ratio[5]: 3.0}]
    res, _ = _run_plan(tiny, script, "think_recaption", True)
    forced = 1 + 3
    assert res.sampled == len(res.tokens) - forced == 6
    assert res.ms_per_token == pytest.approx(res.decode_ms / (res.sampled - 1))
    line = Timings(ar_tokens=res.sampled, ar_forced=forced, ar_ms_per_token=2.0, ar_prefill_ms=5).summary()
    assert "reasoning 6 tokens at 2.0 ms/token" in line and "forced" not in line
    assert "1 tokens" not in Timings(ar_tokens=1, ar_prefill_ms=5).summary()     # reasoning off: one choice


def test_padded_prefill_equals_plain(tiny):
    """On CUDA a short prompt's prefill runs padded to its length bucket (the shape its graph captures).
    The padding must be invisible: the same logits, the same K/V of the prompt, the same decode after it,
    even where the blocks given for the positions after the prompt would join the prompt's last
    full-attention block (the padding is made causal)."""
    from engine.runtime.prefill_step import GRAIN, PrefillStep
    model, tok = tiny.model, tiny.tok
    seq = text_phase_sequence(user_turn(tok, "", "a small green triangle above a red square", []), "think", 256)
    L = len(seq)
    T = seq.tensors(length=L + GRAIN + 8)
    blocks = T["blocks"].clone()
    blocks[L - 4:L + 12] = 7          # a full-attention block ending the prompt, "continued" past it
    view = PhaseView()
    emb = model.transformer.embed(T["ids"][None, :L])
    runs = []
    with torch.no_grad():
        for padded in (False, True):
            cache = _cache(tiny, L + GRAIN + 8)
            prefill = PrefillStep(model, cache, view, padded=padded)
            assert prefill.bucket(L) == (-(-L // GRAIN) * GRAIN if padded else None)
            if padded:       # what an earlier, longer prompt with a block there leaves in the static buffers
                prefill.blocks.fill_(7)
                prefill.emb.normal_()
            logits = [prefill(emb, T["pos"], blocks)]
            for s, t in enumerate(tok.encode(" blue circle")):
                x = model.transformer.embed(torch.tensor([[t]]))
                h = run_backbone(model, x, torch.tensor([L + s]), T["pos"], blocks, cache, L + s + 1, view,
                                 masked=False)
                logits.append(model.transformer.logits(h[:, -1], view)[0])
            runs.append((torch.stack(logits), cache))
    (plain, c0), (pad, c1) = runs
    assert (plain - pad).abs().max().item() <= 1e-4
    for a, b in zip(c0.k + c0.v, c1.k + c1.v):
        assert (a[:, :, :L + 2] - b[:, :, :L + 2]).abs().max().item() <= 1e-5
    assert not torch.equal(plain[0], plain[1])           # the steps really moved on
