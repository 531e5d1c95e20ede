"""The `sample_rows` op (kernels/sampling.py): a batched decode step's rows sampled in one call.

CPU: the batched variant gives every row the token the per-row `sample` op gives it for the same
generator state, bit for bit, and leaves each generator in the state the per-row loop leaves it: mixed
temperatures, top-k off / small / at or past V, top-p off / on, greedy rows, a ratio-token row, rows
sharing one generator, bf16-tied logits whose ties straddle both cuts, at a small V and at the model's.
GPU (`-m gpu`): on CUDA the op is the per-row variants row by row (the batched variant is CPU-only: see
kernels/sampling.py), token for token, without a host read.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import sampling

V_MODEL = 133120
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def logits_of(n: int, V: int, seed: int, levels: int | None = None, device: str = "cpu") -> torch.Tensor:
    """[n, V] fp32: bf16 values upcast (many exact ties), or `levels` distinct values only (large tie
    groups at both cuts); the last ids -inf, as the padded vocabulary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 2.5
    if levels is not None:
        x = (x * levels / 10).round() * (10 / levels)
    x = x.bfloat16().float()
    x[:, -(V // 50):] = float("-inf")
    return x.to(device)


def rows_case(V: int, seed: int, device: str = "cpu") -> dict:
    """A step's rows: (logits row, temperature, top_k, top_p, greedy, ratio ids), in a shuffled order;
    rows 1 and 3 share one generator object, as two rows drawing from the default generator would."""
    allowed = torch.tensor([5, 9, 11, V // 2], device=device)
    rows = [(0, 0.6, 1024, 0.95, False, None), (1, 0.6, 1024, 0.95, False, None), (2, 1.0, 0, 1.0, False, None),
            (3, 0.8, 50, 0.9, False, None), (0, 0.6, 1024, 0.95, False, None), (4, 1.3, 7, 1.0, False, None),
            (5, 0.6, V, 0.9, False, None), (1, 0.6, 1024, 0.95, True, None), (2, 0.6, 1024, 0.95, False, allowed),
            (3, 0.7, 4096, 0.99, False, None), (4, 0.6, 0, 0.95, False, None), (5, 0.6, 3, 0.3, False, None)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [rows[i] for i in order]
    return dict(rows=[r[0] for r in rows], temperature=[r[1] for r in rows], top_k=[r[2] for r in rows],
                top_p=[r[3] for r in rows], greedy=[r[4] for r in rows], allowed=[r[5] for r in rows])


def generators(n: int, seed: int, device: str = "cpu") -> list[torch.Generator]:
    gens = [torch.Generator(device).manual_seed(1000 * seed + i) for i in range(n)]
    gens[3] = gens[1]
    return gens


def run(logits: torch.Tensor, case: dict, gens: list, backends: tuple[str, ...] | None) -> torch.Tensor:
    args = (logits, case["rows"], case["temperature"], case["top_k"], case["top_p"], gens, case["greedy"],
            case["allowed"])
    if backends is None:
        return kernels.call("sample_rows", *args)
    with kernels.allowed(*backends):
        return kernels.call("sample_rows", *args)


def per_row(logits: torch.Tensor, case: dict, gens: list) -> torch.Tensor:
    """The per-row path: the `sample` op once per row, as the scheduler called it before."""
    return torch.stack([kernels.call("sample", logits[r], t, k, p, g, gr, a) for r, t, k, p, g, gr, a in
                        zip(case["rows"], case["temperature"], case["top_k"], case["top_p"], gens, case["greedy"],
                            case["allowed"])])


def check_equal(logits: torch.Tensor, case: dict, seed: int) -> torch.Tensor:
    n = len(case["rows"])
    mine, theirs = generators(n, seed), generators(n, seed)
    got = run(logits, case, mine, ("batched",))
    assert kernels.chosen("sample_rows") == "batched"
    want = per_row(logits, case, theirs)
    assert got.dtype == torch.long and got.shape == (n,)
    assert torch.equal(got, want), (seed, got.tolist(), want.tolist())
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert torch.equal(a.get_state(), b.get_state()), (seed, i)
    return got


@pytest.mark.parametrize("levels", [None, 6])
def test_rows_equal_the_per_row_op_at_a_small_vocabulary(levels):
    V = 300
    for seed in range(60):
        check_equal(logits_of(6, V, seed, levels), rows_case(V, seed), seed)


def test_rows_equal_the_per_row_op_at_the_model_vocabulary():
    for seed in range(2):
        for levels in (None, 8):
            check_equal(logits_of(6, V_MODEL, seed, levels), rows_case(V_MODEL, seed), seed)


def test_a_step_of_sixteen_engine_rows():
    """The engine's default settings on every row: one group, one batched pass."""
    n = 16
    logits = logits_of(n, V_MODEL, 7)
    case = dict(rows=list(range(n))[::-1], temperature=[0.6] * n, top_k=[1024] * n, top_p=[0.95] * n,
                greedy=[False] * n, allowed=[None] * n)
    for seed in range(3):
        got = check_equal(logits, case, seed)
        assert len(set(got.tolist())) > 1


def test_the_tied_logits_straddle_both_cuts():
    """The few-level inputs do test the ties: some top-k cut falls inside a tie group (ties beyond k kept)
    and some top-p cut keeps only part of its group (n_tie of them, the highest ids)."""
    x = logits_of(6, 300, 0, levels=6) / 0.8
    kth = x.topk(50).values[:, -1:]
    assert ((x >= kth).sum(-1) > 50).any()
    thr, n_tie = sampling.cut_ref(x, 50, 0.9)
    assert ((n_tie > 0) & (n_tie < (x == thr).sum(-1, keepdim=True))).any()


def test_a_row_alone_and_in_a_batch_cut_the_same():
    """cut_ref on [b, V] gives each row the bits it gives that row alone (the batched path's premise)."""
    x = logits_of(5, 2000, 3, levels=8) / 0.7
    for k, p in ((64, 0.9), (7, 1.0), (2000, 0.8), (0, 0.5), (33, 0.3)):
        batch = sampling.cut_ref(x, k, p)
        for i in range(x.shape[0]):
            alone = sampling.cut_ref(x[i], k, p)
            assert torch.equal(batch[0][i], alone[0]) and (batch[1] is None) == (alone[1] is None), (k, p, i)
            if alone[1] is not None:
                assert torch.equal(batch[1][i], alone[1]), (k, p, i)


# --------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["triton", "triton_torch_topk"])
def test_gpu_rows_equal_the_per_row_variants_without_host_sync(variant):
    for seed in range(8):
        logits = logits_of(6, V_MODEL, seed, None if seed % 2 else 8, device="cuda")
        case = rows_case(V_MODEL, seed, device="cuda")
        n = len(case["rows"])
        mine, theirs = generators(n, seed, "cuda"), generators(n, seed, "cuda")
        torch.cuda.set_sync_debug_mode("error")        # any host read inside the op raises
        try:
            got = run(logits, case, mine, (variant,))
            with kernels.allowed(variant):
                want = per_row(logits, case, theirs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.device.type == "cuda" and torch.equal(got, want), (seed, got.tolist(), want.tolist())
        for a, b in zip(mine, theirs):
            assert torch.equal(a.get_state(), b.get_state()), seed
