"""The `moe_lora` op (hunyuan_kernels/quant/moe_lora.py): the MoE block with each token's LoRA adapter on the shared
MLP's and every expert's gate_and_up_proj / down_proj equals, token by token, the `moe` op on weights with
that token's adapter merged in (W + strength * B A), on float and on quantized packs, over any micro range;
a token of slot 0 gets the base block's output."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.quant.moe_lora import MoeLora
from hunyuan_kernels.quant import random_qweight

N, H, E, I, IS, MICROS, S, R, K = 12, 64, 4, 32, 32, 2, 3, 4, 2


def tables(g: torch.Generator, shared: bool) -> MoeLora:
    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2
    t = MoeLora(r(E, S, R, H), r(MICROS, E, S, 2 * I, R), r(E, S, R, MICROS * I), r(E, S, H, R),
                *((r(S, R, H), r(MICROS, S, 2 * IS, R), r(S, R, MICROS * IS), r(S, H, R)) if shared else (None,) * 4))
    for x in t.slot(0):                         # slot 0 holds no adapter: zeros, as LoraTables keeps it
        x.zero_()
    return t


def merged(w1, w2, sw1, sw2, lora: MoeLora, s: int, c: float):
    """The packs with slot s's adapter folded in at strength c (fp32)."""
    w1, w2 = w1.clone(), w2.clone()
    for e in range(E):
        for m in range(MICROS):
            w1[m, e] += c * lora.b1[m, e, s] @ lora.a1[e, s]
        w2[e] += c * lora.b2[e, s] @ lora.a2[e, s]
    if sw1 is None:
        return w1, w2, None, None
    sw1, sw2 = sw1.clone(), sw2 + c * lora.sb2[s] @ lora.sa2[s]
    for m in range(MICROS):
        sw1[m] += c * lora.sb1[m, s] @ lora.sa1[s]
    return w1, w2, sw1, sw2


@pytest.mark.parametrize("fmt", [None, "mxfp8", "mxfp4"])
@pytest.mark.parametrize("micro_start,micro_count", [(0, 2), (1, 1)])
@pytest.mark.parametrize("shared", [True, False])
def test_equals_the_moe_op_on_each_tokens_merged_weights(fmt, micro_start, micro_count, shared):
    g = torch.Generator().manual_seed(7)
    x, gate = torch.randn(N, H, generator=g), torch.randn(E, H, generator=g)
    if fmt is None:
        w1, w2 = torch.randn(MICROS, E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, MICROS * I, generator=g) * 0.1
        packs = dense = (w1, w2)
    else:
        packs = (random_qweight(fmt, (MICROS, E, 2 * I, H), std=0.1, generator=g),
                 random_qweight(fmt, (E, H, MICROS * I), std=0.1, generator=g))
        dense = tuple(p.dequantize(torch.float32) for p in packs)
    sw = (torch.randn(MICROS, 2 * IS, H, generator=g) * 0.1, torch.randn(H, MICROS * IS, generator=g) * 0.1) \
        if shared else (None, None)
    lora = tables(g, shared)
    slot = torch.tensor([0, 1, 2, 1, 1, 2, 0, 0, 1, 2, 2, 1])
    strength = torch.tensor([0.0, 1, 0.5, 1, 2, 1, 0, 0, 1, 1.5, 1, 0.25])
    common = (micro_start, micro_count, K, True)
    got = kernels.call("moe_lora", x, gate, *packs, *sw, *common, slot, strength, lora)
    for t in range(N):
        want = kernels.call("moe", x[t:t + 1], gate, *merged(*dense, *sw, lora, int(slot[t]), float(strength[t])),
                            *common)
        torch.testing.assert_close(got[t:t + 1], want, rtol=1e-4, atol=1e-4, msg=f"token {t}")
    base = kernels.call("moe", x, gate, *dense, *sw, *common)
    assert (got - base)[slot == 0].abs().max() < 1e-4 and (got - base)[slot != 0].abs().min() > 0


def test_tokens_of_one_adapter_give_the_same_output_in_any_company():
    """A token's output does not depend on which adapters the other tokens of its call have."""
    g = torch.Generator().manual_seed(3)
    x, gate = torch.randn(N, H, generator=g), torch.randn(E, H, generator=g)
    w1, w2 = torch.randn(MICROS, E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, MICROS * I, generator=g) * 0.1
    lora = tables(g, True)
    args = (x, gate, w1, w2, None, None, 0, MICROS, K, True)
    ones = torch.ones(N)
    alone = kernels.call("moe_lora", *args, torch.full((N,), 1), ones, lora)
    mixed = kernels.call("moe_lora", *args, torch.tensor([1, 2] * (N // 2)), ones, lora)
    torch.testing.assert_close(mixed[0::2], alone[0::2], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [None, "mxfp4"])
def test_gpu_bf16_matches_fp32_and_replays_as_a_cuda_graph(fmt):
    """CUDA bf16 (torch._grouped_mm, the quantized packs' grouped GEMMs): within bf16 of the fp32 op on the CPU,
    and a CUDA graph of it replays to the eager result bit for bit (no host sync in it)."""
    g = torch.Generator().manual_seed(11)
    n, h, e, i, micros, s, r = 64, 512, 8, 128, 2, 3, 32
    x, gate = torch.randn(n, h, generator=g), torch.randn(e, h, generator=g)
    if fmt is None:
        packs = (torch.randn(micros, e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, micros * i, generator=g) * 0.05)
        dense = packs
    else:
        packs = (random_qweight(fmt, (micros, e, 2 * i, h), std=0.05, generator=g),
                 random_qweight(fmt, (e, h, micros * i), std=0.05, generator=g))
        dense = tuple(p.dequantize(torch.float32) for p in packs)
    sw = (torch.randn(micros, 2 * i, h, generator=g) * 0.05, torch.randn(h, micros * i, generator=g) * 0.05)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05
    lora = MoeLora(rnd(e, s, r, h), rnd(micros, e, s, 2 * i, r), rnd(e, s, r, micros * i), rnd(e, s, h, r),
                   rnd(s, r, h), rnd(micros, s, 2 * i, r), rnd(s, r, micros * i), rnd(s, h, r))
    slot = torch.randint(0, s, (n,), generator=g)
    strength = torch.rand(n, generator=g) + 0.5
    common = (0, micros, 8 if e >= 8 else 2, True)
    want = kernels.call("moe_lora", x, gate, *dense, *sw, *common, slot, strength, lora)

    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to("cuda", torch.bfloat16)
    q = tuple(dataclasses.replace(p, codes=p.codes.cuda(), scales=p.scales.cuda()) if fmt else bf(p) for p in packs)
    args = (bf(x), gate.cuda(), *q, *(bf(w) for w in sw), *common, slot.cuda(), bf(strength),
            MoeLora(*(bf(t) for t in lora)))
    eager = kernels.call("moe_lora", *args)
    torch.testing.assert_close(eager.float().cpu(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    kernels.call("moe_lora", *args)                   # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = kernels.call("moe_lora", *args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
