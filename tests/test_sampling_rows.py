"""The `sample_rows` op (hunyuan_kernels/sampling.py): a batched decode step's rows sampled in one call.

CPU: the batched variant gives every row the token the per-row `sample` op gives it for the same
generator state, bit for bit, and leaves each generator in the state the per-row loop leaves it: mixed
temperatures, top-k off / small / at or past V, top-p off / on, greedy rows, a ratio-token row, rows
sharing one generator, bf16-tied logits whose ties straddle both cuts, at a small V and at the model's.
Triton interpreter (CPU, the child run): the row-axis launchers (`sample_rows_device`: the `sample`
kernels with the rows as their grids' second axis) give every row of a group the token and the cut
(thr, n_tie) `sample_device` gives it alone with the same generator state, and the CUDA variant
`triton_rows` run on CPU tensors gives each row of a mixed step the token of the variant `sample` picks
for it on CUDA, generator states included. Without a GPU: the row launches compile for sm_90.
GPU (`-m gpu`): `triton_rows` is the CUDA default and equals the per-row op token for token at the
model's vocabulary; under the per-row variants alone, the reference does, without a host read.
"""
from __future__ import annotations

import pytest
import torch
from kernel_support import INTERPRETED, interpreted, run_interpreter_suite

import hunyuan_kernels as kernels
from hunyuan_kernels import sampling

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


# ---------------------------------------------------------------- Triton, CPU interpreter (child run)

V_INTERP, BLOCK, CHUNK = 1000, 256, 512          # 4 pick chunks, 2 top-k chunks a row (CI's time: the
#                                                   interpreter's cost is per program): ties across chunks


def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture
def interp():
    interpreted()


def device_one(x: torch.Tensor, k: int, p: float, g: torch.Generator):
    """sample_device of one row at the interpreter's block and chunk (what `sample`'s triton variant runs)."""
    return sampling.sample_device(x, k, p, g, block=BLOCK, topk=lambda y, kk: sampling.topk_desc(y, kk, chunk=CHUNK))


def test_interp_row_launches_equal_sample_device_per_row(interp):
    """Per group: every row's token and cut equal sample_device's on that row alone, for the same noise."""
    n = 3
    for levels, t, k, p in ((6, 0.8, 50, 0.9), (None, 0.6, 40, 0.5), (None, 1.0, 0, 1.0)):
        x = logits_of(n, V_INTERP, k, levels) / t
        if k == 50:       # the case does test ties at both cuts in some row (as test_the_tied_logits_...)
            thr, n_tie = sampling.cut_ref(x, k, p)
            assert ((x >= x.topk(k).values[:, -1:]).sum(-1) > k).any()
            assert ((n_tie > 0) & (n_tie < (x == thr).sum(-1, keepdim=True))).any()
        mine = [torch.Generator().manual_seed(100 * k + i) for i in range(n)]
        theirs = [torch.Generator().manual_seed(100 * k + i) for i in range(n)]
        q = torch.empty(n, V_INTERP)
        for j in range(n):
            q[j].exponential_(1, generator=mine[j])
        toks, cuts = sampling.sample_rows_device(x, q, k, p, block=BLOCK, chunk=CHUNK)
        assert toks.shape == (n,) and toks.dtype == torch.long
        for j in range(n):
            tok, cut = device_one(x[j], k, p, theirs[j])
            assert int(toks[j]) == int(tok), (k, p, j)
            if 0 < k and p < 1:
                assert torch.equal(cuts[j], cut), (k, p, j, cuts[j].tolist(), cut.tolist())
                thr, n_tie = sampling.cut_ref(x[j], k, p)
                assert (float(cuts[j, 0]), int(cuts[j, 1])) == (float(thr), int(n_tie)), (k, p, j)
            assert torch.equal(mine[j].get_state(), theirs[j].get_state())
        assert len(set(toks.tolist())) > 1 or k == 1


def interp_case(V: int) -> dict:
    """A mixed step: three groups (one of them two rows sharing a generator), a row alone in its group, a
    top-k above MAX_K_INTERP (the limit scaled to this vocabulary: `sample` would give it torch.topk),
    greedy, ratio tokens and top-p over the whole vocabulary, interleaved."""
    allowed = torch.tensor([5, 9, 11, V // 2])
    rows = [(0, 0.6, 64, 0.95, False, None), (1, 1.0, 0, 1.0, False, None), (2, 0.6, 0, 0.9, False, None),
            (3, 0.6, 64, 0.95, False, None), (4, 0.8, 150, 0.9, False, None), (5, 1.3, 7, 1.0, False, None),
            (1, 0.6, 64, 0.95, True, None), (0, 0.6, 64, 0.95, False, allowed), (2, 1.0, 0, 1.0, False, None),
            (5, 0.6, 64, 0.95, False, None)]
    return dict(rows=[r[0] for r in rows], temperature=[r[1] for r in rows], top_k=[r[2] for r in rows],
                top_p=[r[3] for r in rows], greedy=[r[4] for r in rows], allowed=[r[5] for r in rows])


MAX_K_INTERP = 100     # the `triton` variant's top-k limit scaled to V_INTERP (TOPK_TRITON_MAX_K at V_MODEL)


def on_triton(V: int, k: int, p: float, greedy: bool, allowed, max_k: int) -> bool:
    """Whether `sample` gives the row its `triton` variant on CUDA, with that variant's top-k limit max_k."""
    return sampling._batchable(V, k, p, greedy, allowed, max_k)


def cuda_per_row(logits: torch.Tensor, case: dict, gens: list, max_k: int) -> torch.Tensor:
    """What the per-row loop gives on CUDA, run here: `sample_device` for the rows `sample` gives its triton
    variant there, the op itself (the CPU reference) for the others, in row order."""
    out = []
    for r, t, k, p, g, gr, a in zip(case["rows"], case["temperature"], case["top_k"], case["top_p"], gens,
                                    case["greedy"], case["allowed"]):
        out.append(device_one(logits[r] / t, k, p, g)[0] if on_triton(logits.shape[-1], k, p, gr, a, max_k) else
                   kernels.call("sample", logits[r], t, k, p, g, gr, a))
    return torch.stack(out)


def test_the_rows_triton_rows_takes_are_the_ones_sample_gives_its_triton_variant():
    """At the model's vocabulary and the real limit, the registry's own choice for one row on CUDA (fits
    read shapes and settings only: a CPU tensor of the row's shape serves) agrees with `on_triton`."""
    row, ratio = torch.empty(V_MODEL), torch.tensor([5, 9])
    seen = set()
    for k in (0, 1, 50, sampling.TOPK_TRITON_MAX_K, sampling.TOPK_TRITON_MAX_K + 1, sampling.MAX_TRITON_K,
              sampling.MAX_TRITON_K + 1, V_MODEL):
        for p in (1.0, 0.95):
            for greedy, allowed in ((False, None), (True, None), (False, ratio)):
                args = (row, 0.7, k, p, None, greedy, allowed)
                chosen = next(i for i in kernels.registry.candidates("sample", "cuda", torch.float32)
                              if i.fits is None or i.fits(*args))
                takes = on_triton(V_MODEL, k, p, greedy, allowed, sampling.TOPK_TRITON_MAX_K)
                assert takes == (chosen.backend == "triton"), (k, p, greedy, allowed is not None, chosen.backend)
                seen.add(takes)
    assert seen == {True, False}


def test_interp_triton_rows_equal_the_per_row_op(interp):
    case = interp_case(V_INTERP)
    n = len(case["rows"])
    takes = [on_triton(V_INTERP, k, p, gr, a, MAX_K_INTERP) for k, p, gr, a in
             zip(case["top_k"], case["top_p"], case["greedy"], case["allowed"])]
    assert takes == [True, True, False, True, False, True, False, False, True, True]
    logits = logits_of(6, V_INTERP, 0, 6)
    mine, theirs = generators(n, 0), generators(n, 0)
    got = sampling.sample_rows_triton(*run_args(logits, case, mine), block=BLOCK, chunk=CHUNK, max_k=MAX_K_INTERP)
    want = cuda_per_row(logits, case, theirs, MAX_K_INTERP)
    assert got.dtype == torch.long and got.shape == (n,) and torch.equal(got, want), (got.tolist(), want.tolist())
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert torch.equal(a.get_state(), b.get_state()), i
    # the comparison can fail: other generator states move some token
    other = sampling.sample_rows_triton(*run_args(logits, case, generators(n, 7)), block=BLOCK, chunk=CHUNK,
                                        max_k=MAX_K_INTERP)
    assert not torch.equal(other, got)


def run_args(logits: torch.Tensor, case: dict, gens: list) -> tuple:
    return (logits, case["rows"], case["temperature"], case["top_k"], case["top_p"], gens, case["greedy"],
            case["allowed"])


# ------------------------------------------------------------------- sm_90 compile (no GPU needed)

@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU")
def test_row_kernels_compile_for_hopper():
    """The kernels at the row launches' settings (V 133120) build to sm_90 cubins whose programs read their
    row from the grid's second axis (%ctaid.y)."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends import backends
        assert "nvidia" in backends
    except (ImportError, AssertionError):
        pytest.skip("Triton has no NVIDIA backend here")
    from test_kernels_ops import _sm90_compile      # the sampling kernels' own compile check's helper

    def compile_(fn, sig, const, num_warps):
        assert "%ctaid.y" in _sm90_compile(fn, sig, const, num_warps).asm["ptx"], fn.__name__
    i32, f32 = "i32", "fp32"
    P = triton.cdiv(V_MODEL, sampling.TOPK_CHUNK)
    n = triton.cdiv(V_MODEL, sampling.PICK_BLOCK)
    block_p, block_c = max(2, sampling.next_pow2(P)), max(2, sampling.next_pow2(n))
    for level in (0, 3):
        compile_(sampling._digit_kernel, dict(x_ptr="*fp32", hist_ptr="*i32", V=i32, K=i32, P=i32),
                 dict(LEVEL=level, CHUNK=sampling.TOPK_CHUNK, BLOCK_P=block_p), 8)
    compile_(sampling._compact_kernel, dict(x_ptr="*fp32", hist_ptr="*i32", pack_ptr="*i64", V=i32, K=i32, P=i32),
             dict(CHUNK=sampling.TOPK_CHUNK, BLOCK_P=block_p), 8)
    compile_(sampling._sort_kernel, dict(pack_ptr="*i64", vals_ptr="*fp32", idx_ptr="*i64", K=i32),
             dict(BLOCK_K=64), 8)
    compile_(sampling._count_kernel, dict(x_ptr="*fp32", vals_ptr="*fp32", ge_ptr="*i32", eq_ptr="*i32", V=i32, K=i32),
             dict(BLOCK=sampling.PICK_BLOCK), 8)
    for top_k, top_p, block_k in ((True, True, 64), (True, False, 2), (False, False, 2)):
        compile_(sampling._pick_kernel, dict(
            x_ptr="*fp32", q_ptr="*fp32", vals_ptr="*fp32", idx_ptr="*i64" if top_k else "*fp32", ge_ptr="*i32",
            eq_ptr="*i32", best_ptr="*fp32", arg_ptr="*i32", cut_ptr="*fp32", V=i32, K=i32, NCHUNK=i32, cut=f32),
            dict(BLOCK=sampling.PICK_BLOCK, BLOCK_K=block_k, BLOCK_C=block_c, TOP_K=top_k, TOP_P=top_p), 8)
    compile_(sampling._final_kernel, dict(best_ptr="*fp32", arg_ptr="*i32", out_ptr="*i64", N=i32),
             dict(BLOCK=block_c), 4)


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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 3, 16])
def test_gpu_triton_rows_equal_the_per_row_op_at_the_model_vocabulary(B):
    """The CUDA default, token for token against the per-row op: the engine's settings on every row (one
    group), then two settings interleaved with the rows it hands to `sample` (greedy, whole-vocabulary
    top-p, a top-k above TOPK_TRITON_MAX_K), rows sharing a generator; generator states included."""
    plain = dict(rows=list(range(B))[::-1], temperature=[0.6] * B, top_k=[1024] * B, top_p=[0.95] * B,
                 greedy=[False] * B, allowed=[None] * B)
    settings = [(0.6, 1024, 0.95, False), (1.0, 50, 0.9, False), (0.6, 0, 0.9, False), (0.8, 2048, 0.95, False),
                (0.6, 1024, 0.95, True)]
    mixed = dict(rows=[i % 6 for i in range(B)], temperature=[settings[i % 5][0] for i in range(B)],
                 top_k=[settings[i % 5][1] for i in range(B)], top_p=[settings[i % 5][2] for i in range(B)],
                 greedy=[settings[i % 5][3] for i in range(B)], allowed=[None] * B)
    for seed in range(4):
        logits = logits_of(max(B, 6), V_MODEL, seed, None if seed % 2 else 8, device="cuda")
        for case in (plain, mixed):
            mine = [torch.Generator("cuda").manual_seed(1000 * seed + i) for i in range(B)]
            theirs = [torch.Generator("cuda").manual_seed(1000 * seed + i) for i in range(B)]
            if B > 3:
                mine[3], theirs[3] = mine[1], theirs[1]
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = run(logits, case, mine, None)
                assert kernels.chosen("sample_rows") == "triton_rows"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = per_row(logits, case, theirs)
            assert got.device.type == "cuda" and torch.equal(got, want), (B, seed, got.tolist(), want.tolist())
            for a, b in zip(mine, theirs):
                assert torch.equal(a.get_state(), b.get_state()), (B, seed)
