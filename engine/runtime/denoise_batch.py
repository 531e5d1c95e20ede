"""Denoise steps batched across requests: the requests holding denoise rows, and the one forward that
serves all of them.

A denoise batch is the requests in their denoise phase, of one step class at a time (same resolution
bucket and rows per request, whatever their prompt + CoT lengths; engine/runtime/denoise.py `step_class`),
at most `limit` of them. Their rows sit side by side in the KV pool's denoise storage from row 0, in the order
they joined (request k: rows [k * rows, (k + 1) * rows), its CFG branches and images branch-major as a
request alone has them). When one ends, the ones after it move down (a copy of their cache rows on the
device), so the batch's rows stay [0, members * rows) and one step graph per (key, members) serves it.

Each turn, one forward computes every member's step: each its own latent, its own time (members may be
at different steps, even of different step counts), its own prefix (its cache rows, its RoPE positions,
its key mask: the rows of one request never see another's keys, AttnBatch.key_mask; a prefix of any
length: every member's step tokens sit at the largest tail among them, `tail_index`, and its key mask hides
the gap after its own prefix, so one graph per (tail bucket, members) serves the batch), its own LoRA adapter
(or none: each denoise row has its request's, engine/runtime/kv_pool.py `set_denoise_adapter`), then each
request's rows are sliced back out. Only the latents and times are written each turn; the members' step
tables (positions, masks) are written into the batch's buffers when the members change (a join, a
leave). A request alone (one member) runs its own runner's step (`DenoiseRunner.velocity`).
A cancel or a failure of one request (in its own part: its hand-off, prefill, update, preview, VAE)
ends only it; a failure of the shared forward fails every request in it, as the batched decode step.

Not batched, each alone in its batch: a request with a step cache (its policy decides per step whether
the backbone runs at all, and the block cache decides on the host from its own residuals: no shared
forward can follow two policies), and the plans whose step is not one plain forward over local rows
(sequence parallel, CFG-parallel, CFG branches run one after the other): `DenoiseRows.alone`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.attention import AttnBatch, KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.lora import LoraRows, lora_key
from engine.parallel.layout import PhaseView
from engine.runtime.denoise import StepInput, StepInputs, tail_embeddings, velocity
from engine.runtime.graphs import Graphs
from engine.runtime.kv_pool import KVPool
from engine.runtime.needs import DenoiseRows, DenoiseStep

if TYPE_CHECKING:
    from engine.runtime.request_state import RequestState


@dataclass
class BatchBuffers:
    """The static inputs of a batched step graph (key, members): every member's latents and times
    (`inputs`, members side by side) and step tables; `rows` [N] maps each cache row to its image in x (a
    request's branches share its image embeddings). `members`: the batch's membership
    (`DenoiseBatch.members_version`) whose step tables are in `batch`."""
    inputs: StepInputs
    rows: torch.Tensor
    batch: AttnBatch
    members: int = -1


class DenoiseBatch:
    def __init__(self, model: HunyuanImage3, pool: KVPool, heads: slice, view: PhaseView, graphs: Graphs, limit: int):
        """heads: the denoise heads of the pool's rows; limit: requests in one batch (`max_denoise_batch`)."""
        if limit < 1:
            raise ValueError(f"max_denoise_batch must be >= 1 (got {limit})")
        self.model, self.pool, self.heads, self.view, self.graphs, self.limit = model, pool, heads, view, graphs, limit
        self.members: list["RequestState"] = []
        self.key: tuple = ()
        self.rows = 0
        self.alone = False
        self.members_version = 0     # changes at each join and leave: the batch buffers' tables are rewritten
        self.forwards = 0            # forwards run for the batch (one per turn; tests count them)
        self.member_steps = 0        # request steps they computed (/ forwards: the mean batch, bench serving)

    # ------------------------------------------------------------------ who holds rows
    def join(self, state: "RequestState") -> int | None:
        """The first row of `state` (waiting for its DenoiseRows) in the batch, or None: `fits` says no."""
        need: DenoiseRows = state.need
        if not self.fits(need):
            return None
        if not self.members:
            self.key, self.rows, self.alone = need.key, need.rows, need.alone
        first = len(self.members) * self.rows
        self.members.append(state)
        self.members_version += 1
        return first

    def fits(self, need: DenoiseRows) -> bool:
        """Whether a request asking for `need` may join now: the batch is empty, or it is of the batch's step
        class, neither runs alone, the batch is not full and its rows fit the storage while others hold it."""
        if not self.members:
            return True
        return not (len(self.members) >= self.limit or self.alone or need.alone or need.key != self.key
                    or not self.pool.denoise_fits((len(self.members) + 1) * self.rows, need.length))

    def leave(self, state: "RequestState") -> None:
        """`state` ended: the members after it move down by its rows (their runners follow)."""
        if state not in self.members:
            return
        k = self.members.index(state)
        self.members.pop(k)
        self.members_version += 1
        for j in range(k, len(self.members)):
            job = self.members[j].need.job if isinstance(self.members[j].need, DenoiseStep) else None
            if job is None:      # joined this turn and not yet advanced to its rows: nothing to move
                continue
            runner = job.runner
            cache = self.pool.move_denoise((j + 1) * self.rows, j * self.rows, self.rows, runner.cache.max_len)
            runner.cache = cache.heads(self.heads)
        self.pool.clear_denoise_adapter(len(self.members) * self.rows, self.rows)    # the rows no one holds now

    # ------------------------------------------------------------------ the step
    def velocities(self, jobs: list[StepInput]) -> list[torch.Tensor]:
        """Each member's v for its step (members in row order): one forward for all of them."""
        self.forwards += 1
        self.member_steps += len(jobs)
        if len(jobs) == 1:
            j = jobs[0]
            return [j.runner.velocity(j.i, j.inputs)]
        lead, rows = jobs[0].runner, self.rows
        tail = max(j.runner.tail for j in jobs)                    # every member's step tokens there
        mode, lora = self.pool.denoise_lora(len(jobs) * rows)     # the members' adapters: a graph per mode
        # the solo key of its tail and this one go together (engine/runtime/graphs.py `keep_recent`)
        key = (*lead.key_at(tail), ("batch", len(jobs)), *lora_key(mode))
        buf = self.graphs.buffers(key, lambda: self._buffers(jobs, lora, tail))
        self._fill(buf, jobs, tail)
        cache = KVCache([t[:len(jobs) * rows] for t in self.pool.denoise.k],
                        [t[:len(jobs) * rows] for t in self.pool.denoise.v]).heads(self.heads)
        span, model = lead.span, self.model

        def forward() -> torch.Tensor:
            tail = tail_embeddings(model, *buf.inputs.tensors()).index_select(0, buf.rows)
            hidden = model.backbone(tail, buf.batch, cache, self.view)
            return velocity(model, hidden[:, -span.h * span.w:], buf.inputs.t.index_select(0, buf.rows), span)
        v = self.graphs.replay(key, forward, warmup=2) if lead.use_graph else forward()
        return [v[k * rows:(k + 1) * rows] for k in range(len(jobs))]

    def _buffers(self, jobs: list[StepInput], lora: LoraRows | None, tail: int) -> BatchBuffers:
        """A batched key's buffers, shaped from its first members (outside any capture)."""
        lead = jobs[0].runner
        m, n, rows = len(jobs), lead.images, self.rows
        _, _, b = lead.step_layout(self.model.device, tail)

        def per_row(v: torch.Tensor | None) -> torch.Tensor | None:
            if v is None:         # cos/sin [T, D] -> [N, T, D]; masks [1, 1, q, K] -> [N, 1, q, K]
                return None
            return v.new_zeros((m * rows, *(v.shape[1:] if v.dim() == 4 else v.shape)))
        j = jobs[0].inputs
        x = j.x.new_zeros((m * n, *j.x.shape[1:]))
        ts = [None if v is None else v.new_zeros(m * n) for v in (j.t, j.r, j.g)]
        img = torch.arange(m * n, device=x.device).view(m, 1, n)
        row_image = img.expand(m, rows // n, n).reshape(-1)      # row k*rows + b*n + i -> image k*n + i
        batch = AttnBatch(b.index, per_row(b.cos), per_row(b.sin), b.kv_len, per_row(b.mask), b.gathered,
                          b.masked_rows, key_mask=per_row(b.key_mask), lora=lora)
        return BatchBuffers(StepInputs(x, *ts), row_image, batch)

    def _fill(self, buf: BatchBuffers, jobs: list[StepInput], tail: int) -> None:
        """This turn's latents and times, and, when the members changed since these buffers last served,
        the members' step tables (their RoPE positions and masks)."""
        n, rows = jobs[0].runner.images, self.rows
        for k, j in enumerate(jobs):
            buf.inputs.x[k * n:(k + 1) * n].copy_(j.inputs.x)
            for dst, src in zip(buf.inputs.tensors()[1:], j.inputs.tensors()[1:]):
                if dst is not None:
                    dst[k * n:(k + 1) * n].copy_(src.expand(n))
        if buf.members == self.members_version:
            return
        buf.members = self.members_version
        for k, j in enumerate(jobs):
            _, _, b = j.runner.step_layout(self.model.device, tail)
            for name in ("cos", "sin", "mask", "key_mask"):
                dst = getattr(buf.batch, name)
                dst[k * rows:(k + 1) * rows].copy_(getattr(b, name).expand(rows, *dst.shape[1:]))
