"""The `lora_add` op (hunyuan_kernels/lora.py): a projection's output plus each row's LoRA update, in place.

CPU: the reference equals the fp64 formula on each row's own slot, in both of its forms (one slot for every
row, a slot per row), over strided views of packed tables; the Triton variant (shrink, expand) runs in Triton's
interpreter against the reference (fp32 and bf16). GPU (`-m gpu`): the Triton variant is the one chosen at
decode sizes, within bf16 rounding of the reference, a row's result the same in any batch, and a CUDA-graph
replay equal to eager."""
from __future__ import annotations

import pytest
import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.lora import lora_add_ref
from kernel_support import interpreted, rel_err, run_interpreter_suite

S, R, K, N, MICROS = 4, 8, 96, 80, 2


def tables(g: torch.Generator, dtype=torch.float32):
    """a [S, R, K] and b [S, N, R] as the engine slices them: b a micro's rows of a [S, MICROS, N, R] pack, a
    one micro's input columns of a [S, R, MICROS * K] pack (strided views), slot 0 zeros."""
    a = torch.randn(S, R, MICROS * K, generator=g) * K ** -0.5
    b = torch.randn(S, MICROS, N, R, generator=g) * 0.1
    a[0], b[0] = 0, 0
    return a.to(dtype)[..., K:], b.to(dtype)[:, 1]


def formula(out, x, a, b, slot, strength):
    bsz = out.shape[0]
    slot, strength = slot.expand(bsz), strength.expand(bsz)
    rows = [out[i].double() + strength[i].double() * (x[i].double() @ a[slot[i]].double().t()) @ b[slot[i]].double().t()
            for i in range(bsz)]
    return torch.stack(rows)


@pytest.mark.parametrize("one", [True, False])
def test_reference_is_each_rows_own_update(one):
    g = torch.Generator().manual_seed(1)
    a, b = tables(g)
    x, out = torch.randn(3, 5, K, generator=g), torch.randn(3, 5, N, generator=g)
    slot = torch.tensor([2]) if one else torch.tensor([1, 0, 3])
    strength = torch.tensor([0.5, 1.0, 2.0])
    want = formula(out, x, a, b, slot, strength)
    got = kernels.call("lora_add", out.clone(), x, a, b, slot, strength)
    assert kernels.chosen("lora_add") == "torch"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if not one:      # slot 0 adds exact zeros
        assert torch.equal(got[1], out[1])


# ---- Triton interpreter (CPU) ---------------------------------------------------------------------

def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", ["one", "rows", "one-strength"])
def test_interp_triton_variant_equals_the_reference(dtype, slots):
    lora = interpreted("hunyuan_kernels.lora")
    g = torch.Generator().manual_seed(2)
    a, b = tables(g, dtype)
    x = torch.randn(4, 1, K, generator=g).to(dtype)
    out = torch.randn(4, 1, N, generator=g).to(dtype)
    slot = {"one": torch.tensor([3]), "rows": torch.tensor([1, 0, 3, 2]), "one-strength": torch.tensor([2])}[slots]
    strength = torch.tensor([1.5]) if slots == "one-strength" else torch.tensor([0.5, 1.0, 2.0, 0.0])
    strength = strength.to(dtype)
    assert lora._fits(out, x, a, b, slot, strength)
    got = lora.lora_add_triton(out.clone(), x, a, b, slot, strength)
    want = lora.lora_add_ref(out.clone(), x, a, b, slot, strength)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:       # the same roundings of u; the sums in another order: within a unit or two of bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if slots == "rows":
        assert torch.equal(got[1], out[1])


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_triton_variant_at_decode_sizes(rows):
    """Real shapes of a hybrid4 AR rank (qkv: K 4096 -> N 1536; o_proj: K 1024 -> N 4096), rank 32, bf16."""
    g = torch.Generator().manual_seed(3)
    for k, n in ((4096, 1536), (1024, 4096)):
        a = (torch.randn(5, 32, 2 * k, generator=g) * k ** -0.5).to("cuda", torch.bfloat16)[..., k:]
        b = (torch.randn(5, 2, n, 32, generator=g) * 0.05).to("cuda", torch.bfloat16)[:, 1]
        x = torch.randn(rows, 1, k, generator=g).to("cuda", torch.bfloat16)
        out = torch.randn(rows, 1, n, generator=g).to("cuda", torch.bfloat16)
        slot = torch.randint(0, 5, (rows,), generator=g).cuda()
        strength = (torch.rand(rows, generator=g) + 0.5).to("cuda", torch.bfloat16)
        got = kernels.call("lora_add", out.clone(), x, a, b, slot, strength)
        assert kernels.chosen("lora_add") == "triton"
        want = lora_add_ref(out.clone(), x, a, b, slot, strength)
        assert rel_err(got - out, want - out) < 2e-2
        alone = kernels.call("lora_add", out[:1].clone(), x[:1], a, b, slot[:1], strength[:1])
        assert torch.equal(alone, got[:1])                      # a row's result in any batch
        graph, static = torch.cuda.CUDAGraph(), out.clone()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            kernels.call("lora_add", static, x, a, b, slot, strength)
        static.copy_(out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, got)
