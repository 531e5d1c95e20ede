"""LoRA adapters applied unmerged, several at once: each batch row picks its adapter by slot.

`LoraTables` holds every loaded adapter of one rank in fixed device tables, one slot per adapter and
slot 0 all zeros (no adapter), allocated once for `capacity` adapters up to `max_rank`, so loading or
removing one writes into the tables and never moves them (captured CUDA graphs stay valid). Per
decoder layer, sharded like the base weights (engine/model/packed.py) so each rank keeps only its slice:
- qkv_proj is column-parallel: A [r, H] whole, B [out, r] by the output rows of the rank's micros,
  packed [micros, rows, r] like the qkv pack, a phase using its micros' rows;
- o_proj is row-parallel: A [r, in] by the input columns of the rank's micros, packed side by side like
  the o_proj pack, B [H, r] whole; each rank's B (A_slice x_slice) is a partial sum that the layer's
  all-reduce adds up, as it does the base projection's.
PEFT's scale (alpha / r) is folded into B at load; a rank below `max_rank` is zero-padded (exact).

`LoraRows` is what a forward carries (in `AttnBatch`): the slot of each batch row ([B], or [1] for
every row alike) and its strength (the request's scale), device tensors that the runtime writes once per
request, never per step. A layer adds strength * (x A[slot]^T) B[slot]^T to its projection: gathered
per row, two batched matmuls, no host read and no branch on the data. A row of slot 0 adds exact zeros,
so it gives the base model's output bit for bit; the base weights may be quantized (the product is
added to whatever the base projection returns).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.peft import AdapterError, PeftAdapter, read_peft, sliced
from engine.parallel.layout import PhaseView, ShardLayout
from engine.spec import names
from engine.spec.config import ModelConfig


@dataclass(frozen=True)
class LoraRows:
    """The adapter of each row of a forward: slot [B] or [1] (int64), strength of the same shape (the
    tables' dtype); views of static buffers owned by the runtime."""
    tables: "LoraTables"
    slot: torch.Tensor
    strength: torch.Tensor

    def add_qkv(self, out: torch.Tensor, x: torch.Tensor, layer: int, view: PhaseView) -> None:
        """out [B, T, N] += the rows' low-rank product on the qkv rows of the view's micros."""
        t = self.tables
        b = t.qkv_b[layer][:, view.micros]
        self._add(out, x, t.qkv_a[layer], b.reshape(b.shape[0], -1, b.shape[-1]))

    def add_o(self, out: torch.Tensor, x: torch.Tensor, layer: int, view: PhaseView) -> None:
        """out [B, T, H] += the rows' low-rank product on the o_proj columns of the view's micros."""
        t = self.tables
        c = t.o_a.shape[-1] // t.micros
        a = t.o_a[layer][..., view.micro_start * c:(view.micro_start + view.micro_count) * c]
        self._add(out, x, a, t.o_b[layer])

    def _add(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        # a [S, R, K], b [S, N, R] -> this forward's rows: [B or 1, R, K], [B or 1, N, R] (matmul broadcasts [1])
        u = torch.matmul(x, a.index_select(0, self.slot).transpose(1, 2))
        u.mul_(self.strength.view(-1, 1, 1))
        out.add_(torch.matmul(u, b.index_select(0, self.slot).transpose(1, 2)))


class LoraTables:
    """Every loaded adapter of this rank, by slot (slot 0: none)."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, capacity: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str):
        if capacity < 1 or max_rank < 1:
            raise ValueError(f"LoRA tables need capacity >= 1 and max_rank >= 1 (got {capacity}, {max_rank})")
        self.cfg, self.layout, self.max_rank, self.micros = cfg, layout, max_rank, layout.micros
        L, S, R, H, D = cfg.num_layers, capacity + 1, max_rank, cfg.hidden_size, cfg.head_dim
        self.qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
        self.o_in = cfg.num_heads * D
        rows = layout.split(self.qkv_out, "the qkv_proj rows")
        cols = layout.split(self.o_in, "the o_proj columns")

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.qkv_a, self.qkv_b = zeros(L, S, R, H), zeros(L, S, layout.micros, rows, R)
        self.o_a, self.o_b = zeros(L, S, R, layout.micros * cols), zeros(L, S, H, R)
        self.names: list[str | None] = [None] * S         # slot -> adapter name (slot 0 stays None)
        self.folders: dict[str, str] = {}

    @property
    def capacity(self) -> int:
        return len(self.names) - 1

    def slot_of(self, name: str) -> int:
        if name not in self.names[1:]:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        return self.names.index(name, 1)

    def loaded(self) -> list[str]:
        return [n for n in self.names[1:] if n is not None]

    def install(self, name: str, adapter: PeftAdapter) -> int:
        """Write the adapter's slices into a free slot (this rank's share of each layer); returns the slot."""
        if not name or name in self.names:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded" if name else
                               "a LoRA adapter needs a name")
        if adapter.rank > self.max_rank:
            raise AdapterError(f"LoRA adapter {adapter.folder}: rank {adapter.rank} is above the engine's "
                               f"max LoRA rank {self.max_rank}")
        if None not in self.names[1:]:
            raise AdapterError(f"cannot load LoRA adapter {name!r}: all {self.capacity} adapter slots are in use "
                               "(unload one first)")
        if adapter.layout == ShardLayout() != self.layout:
            adapter = sliced(adapter, self.layout)        # a whole adapter (made in memory): this rank's slices
        if adapter.layout != self.layout:
            raise AdapterError(f"LoRA adapter {adapter.folder} was read for {adapter.layout}, not this rank's "
                               f"{self.layout}")
        s = self.names.index(None, 1)
        self._clear(s)
        for i in range(self.cfg.num_layers):
            n = names.layer(i)
            if (w := adapter.layers.get(n.qkv_proj)) is not None:       # B: this shard's rows, as [micros, rows, r]
                r = w.rank
                self.qkv_a[i, s, :r].copy_(w.a)
                self.qkv_b[i, s, ..., :r].copy_((w.b * w.scale).view(self.micros, -1, r))
            if (w := adapter.layers.get(n.o_proj)) is not None:         # A: this shard's input columns
                r = w.rank
                self.o_a[i, s, :r].copy_(w.a)
                self.o_b[i, s, :, :r].copy_(w.b * w.scale)
        self.names[s] = name
        self.folders[name] = str(adapter.folder)
        return s

    def remove(self, name: str) -> None:
        s = self.slot_of(name)
        self._clear(s)
        self.names[s] = None
        self.folders.pop(name, None)

    def _clear(self, s: int) -> None:
        for t in (self.qkv_a, self.qkv_b, self.o_a, self.o_b):
            t[:, s].zero_()


class RowAdapters:
    """Static per-row adapter buffers for `n` batch rows (AR slots, denoise rows): a request's row is set
    when it takes the row; forwards read views of them (`rows`), so a captured graph serves every request."""

    def __init__(self, tables: LoraTables, n: int):
        dev = tables.qkv_a.device
        self.tables = tables
        self.slot = torch.zeros(n, dtype=torch.long, device=dev)
        self.strength = torch.zeros(n, dtype=tables.qkv_a.dtype, device=dev)

    def set(self, rows: int | slice, slot: int, strength: float) -> None:
        """The adapter (table slot, 0: none) and strength of a row, or of a request's rows."""
        self.slot[rows] = slot
        self.strength[rows] = strength if slot else 0.0

    def copy(self, dst: int | slice, src: int | slice) -> None:
        """Row(s) dst take row(s) src's adapter (on the device; ranges of one length, not overlapping)."""
        self.slot[dst] = self.slot[src]
        self.strength[dst] = self.strength[src]

    def rows(self, rows: slice) -> LoraRows:
        return LoraRows(self.tables, self.slot[rows], self.strength[rows])


def load_adapter(tables: LoraTables, name: str, folder: str | Path) -> int:
    """Read this rank's slices of the PEFT folder and install them as `name`; returns its slot."""
    return tables.install(name, read_peft(folder, tables.cfg, tables.layout))
