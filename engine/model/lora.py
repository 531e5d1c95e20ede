"""LoRA adapters applied unmerged, several at once: each batch row picks its adapter by slot.

`LoraTables` holds every loaded adapter of one rank in fixed device tables, one slot per adapter and
slot 0 all zeros (no adapter), allocated once for `capacity` adapters up to `max_rank`, so loading or
removing one writes into the tables and never moves them (captured CUDA graphs stay valid). Per
decoder layer, sharded like the base weights (engine/model/packed.py) so each rank keeps only its slice:
- qkv_proj is column-parallel: A [r, H] whole, B [out, r] by the output rows of the rank's micros,
  packed [micros, rows, r] like the qkv pack, a phase using its micros' rows;
- o_proj is row-parallel: A [r, in] by the input columns of the rank's micros, packed side by side like
  the o_proj pack, B [H, r] whole; each rank's B (A_slice x_slice) is a partial sum that the layer's
  all-reduce adds up, as it does the base projection's;
- with `mlp`, the MLPs too (the shared MLP's and every expert's gate_and_up_proj, column-parallel, and
  down_proj, row-parallel, by the same rules): `MoeLora` tables per layer, which the `moe_lora` op
  (hunyuan_kernels/quant/moe_lora.py) applies inside the experts (the gate/up update enters before the SwiGLU).
  They cost about (2H + 3I/ranks) * R * E values a layer a slot (the experts dominate): allocated only
  when asked for (`--lora-mlp`, or an adapter of the MLPs among those loaded at start).
PEFT's scale (alpha / r) is folded into B at load; a rank below `max_rank` is zero-padded (exact).

`LoraRows` is what a forward carries (in `AttnBatch`): the slot of each batch row ([B], or [1] for
every row alike) and its strength (the request's scale), device tensors that the runtime writes once per
request, never per step. A layer adds strength * (x A[slot]^T) B[slot]^T to its projection: gathered
per row and two batched matmuls, or, with one slot for every row, that slot's A and B taken once and two
plain matmuls over every row's tokens; no host read and no branch on the data. A row of slot 0 adds
exact zeros, so it gives the base model's output bit for bit; the base weights may be quantized (the
product is added to whatever the base projection returns).

`RowAdapters` (the runtime's per-row buffers) decides on the host, when rows are set, which of these a
forward over its rows needs (`mode`): "off" when no row in use has an adapter (the forward carries no
LoraRows at all: the base step, nothing added), "one" when they all have the same adapter (the one-slot
form), "rows" otherwise; "+mlp" when an adapter in use adapts the MLPs (the MoE then runs `moe_lora`
instead of its fused kernels and, in "rows+mlp", also the base op, each row keeping the base output
unless its adapter adapts the MLPs: a request without one gives its solo output bit for bit). A step
graph is captured per mode (its key says which).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.quant.moe_lora import MoeLora

from engine.model.peft import ALL_TARGETS, TARGETS, AdapterError, LoraWeights, PeftAdapter, read_peft, sliced
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint import names
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ
from engine.checkpoint.config import ModelConfig


@dataclass(frozen=True)
class LoraRows:
    """The adapter of each row of a forward: slot [B] or [1] (int64), strength of the same shape (the
    tables' dtype); views of static buffers owned by the runtime. `mlp`: an adapter of these rows adapts
    the MLPs (the MoE applies it); `select`: the rows may mix adapters that do and adapters that do not
    (the MoE runs the base op too and each row keeps the output its own adapter calls for)."""
    tables: "LoraTables"
    slot: torch.Tensor
    strength: torch.Tensor
    mlp: bool = False
    select: bool = False

    def per_token(self, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, strength) of each token of a [rows, tokens] forward, [rows * tokens] (the `moe_lora` op's)."""
        return tuple(t.view(-1, 1).expand(rows, tokens).reshape(-1) for t in (self.slot, self.strength))

    def adapts_mlp(self) -> torch.Tensor:
        """[B, 1, 1] bool: whether each row's adapter adapts the MLPs (`select`: those rows take `moe_lora`'s
        output, the others the base op's)."""
        return self.tables.adapts_mlp.index_select(0, self.slot).view(-1, 1, 1)

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
        # a [S, R, K], b [S, N, R]; x [B, T, K], out [B, T, N]: the `lora_add` op (hunyuan_kernels/lora.py), in place
        kernels.call("lora_add", out, x, a, b, self.slot, self.strength)

class LoraTables:
    """Every loaded adapter of this rank, by slot (slot 0: none)."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, capacity: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, mlp: bool = False):
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
        self.mlp: list[MoeLora] | None = None             # per layer, with `mlp` (module docstring)
        if mlp:
            M = layout.micros
            self.mlp = []
            for i in range(L):
                E = cfg.num_experts[i]
                inter = layout.split(cfg.moe_intermediate_size[i], "the expert intermediate size")
                shared = cfg.shared_intermediate(i)
                si = layout.split(shared, "the shared MLP intermediate size") if shared else 0
                self.mlp.append(MoeLora(zeros(E, S, R, H), zeros(M, E, S, 2 * inter, R), zeros(E, S, R, M * inter),
                                        zeros(E, S, H, R), *((zeros(S, R, H), zeros(M, S, 2 * si, R),
                                                               zeros(S, R, M * si), zeros(S, H, R)) if shared
                                                              else (None,) * 4)))
        self.adapts_mlp = torch.zeros(S, dtype=torch.bool, device=device)    # slot -> its adapter adapts the MLPs
        self.mlp_slots: set[int] = set()                  # ... on the host (RowAdapters' mode)
        self.names: list[str | None] = [None] * S         # slot -> adapter name (slot 0 stays None)
        self.folders: dict[str, str] = {}

    @property
    def targets(self) -> tuple[str, ...]:
        """The layers' linears an adapter may adapt in these tables."""
        return TARGETS if self.mlp is None else ALL_TARGETS

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
        mlp = adapter.adapts_mlp
        if mlp and self.mlp is None:
            raise AdapterError(f"LoRA adapter {adapter.folder} adapts the MLPs ({mlp}); this engine's adapter "
                               "tables hold the attention projections only (start it with --lora-mlp)")
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
            if mlp:
                self._install_mlp(adapter, i, s)
        if mlp:
            self.adapts_mlp[s] = True
            self.mlp_slots.add(s)
        self.names[s] = name
        self.folders[name] = str(adapter.folder)
        return s

    def _install_mlp(self, adapter: PeftAdapter, i: int, s: int) -> None:
        """Layer i's MLP weights of the adapter into slot s: gate/up B as the w1 pack's micros hold the rows
        ([micros, 2 * I_micro, r]: peft.py `_slice` has put them in that order), down A by input columns."""
        n, t, get = names.layer(i), self.mlp[i], adapter.layers.get
        for e in range(t.a1.shape[0]):
            _put(t.a1[e, s], t.b1[:, e, s], get(n.expert(e, GATE_AND_UP_PROJ)))
            _put(t.a2[e, s], t.b2[e, s], get(n.expert(e, DOWN_PROJ)))
        if t.sa1 is not None:
            _put(t.sa1[s], t.sb1[:, s], get(n.shared(GATE_AND_UP_PROJ)))
            _put(t.sa2[s], t.sb2[s], get(n.shared(DOWN_PROJ)))

    def remove(self, name: str) -> None:
        s = self.slot_of(name)
        self._clear(s)
        self.names[s] = None
        self.folders.pop(name, None)

    def _clear(self, s: int) -> None:
        for t in (self.qkv_a, self.qkv_b, self.o_a, self.o_b):
            t[:, s].zero_()
        for layer in self.mlp or ():
            for t in layer.slot(s):
                t.zero_()
        self.adapts_mlp[s] = False
        self.mlp_slots.discard(s)


MODES = ("off", "one", "rows", "one+mlp", "rows+mlp")     # how a forward applies its rows' adapters (module docstring)


class RowAdapters:
    """Static per-row adapter buffers for `n` batch rows (AR slots, denoise rows): a request's rows are set
    when it takes them and cleared when it leaves them (idle: their output is not read, their adapter does
    not count); forwards read views of them (`rows`), so a captured graph serves every request. A host copy
    of the rows decides `mode` over the rows in use whenever they change; in mode "one" `common` [1] holds
    their slot."""

    def __init__(self, tables: LoraTables, n: int):
        dev = tables.qkv_a.device
        self.tables = tables
        self.slot = torch.zeros(n, dtype=torch.long, device=dev)
        self.strength = torch.zeros(n, dtype=tables.qkv_a.dtype, device=dev)
        self.common = torch.zeros(1, dtype=torch.long, device=dev)
        self._host: list[tuple[int, float] | None] = [None] * n      # (slot, strength) of each row in use
        self._common = 0
        self.mode = "off"
        self._views: dict[tuple, LoraRows] = {}

    def set(self, rows: int | slice, slot: int, strength: float) -> None:
        """The adapter (table slot, 0: none) and strength of a row, or of a request's rows."""
        self._write(rows, slot, strength if slot else 0.0, in_use=True)

    def clear(self, rows: int | slice) -> None:
        """The rows are idle: no adapter, and they no longer count for `mode`."""
        self._write(rows, 0, 0.0, in_use=False)

    def copy(self, dst: int | slice, src: int | slice) -> None:
        """Row(s) dst take row(s) src's adapter (on the device; ranges of one length, not overlapping)."""
        self.slot[dst] = self.slot[src]
        self.strength[dst] = self.strength[src]
        self._host[_slice(dst)] = self._host[_slice(src)]
        self._decide()

    def _write(self, rows: int | slice, slot: int, strength: float, in_use: bool) -> None:
        self.slot[rows] = slot
        self.strength[rows] = strength
        sl = _slice(rows)
        self._host[sl] = [(slot, strength) if in_use else None] * len(self._host[sl])
        self._decide()

    def of(self, row: int) -> tuple[int, float]:
        """(slot, strength) of a row (0, 0.0 when idle)."""
        return self._host[row] or (0, 0.0)

    def _decide(self) -> None:
        """`mode` for the rows in use, and `common` (a device write only when the shared slot changes)."""
        live = {h[0] for h in self._host if h is not None}
        mlp = "+mlp" if live & self.tables.mlp_slots else ""
        if len(live) > 1:
            self.mode = "rows" + mlp
            return
        s = live.pop() if live else 0
        self.mode = "one" + mlp if s else "off"
        if s and s != self._common:
            self.common.fill_(s)
            self._common = s

    def rows(self, rows: slice, mode: str | None = None) -> LoraRows | None:
        """The adapter rows of a forward over `rows` as `mode` (default: the current one) applies them:
        None for "off", the one-slot form (`common`) for "one", else each row's own; views made once."""
        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"unknown LoRA rows mode {mode!r} (one of {', '.join(MODES)})")
        if mode == "off":
            return None
        key = (rows.start, rows.stop, mode)
        if key not in self._views:
            slot = self.common if mode.startswith("one") else self.slot[rows]
            self._views[key] = LoraRows(self.tables, slot, self.strength[rows], mode.endswith("+mlp"),
                                        mode == "rows+mlp" and rows.stop - rows.start > 1)
        return self._views[key]

    def row(self, row: int) -> LoraRows | None:
        """The adapter of a forward of this row alone (its slot as set now; None without an adapter)."""
        return self.rows(slice(row, row + 1), self.alone(self.of(row)[0]))

    def alone(self, slot: int) -> str:
        """The mode of a forward of one request's rows with this adapter (table slot; 0: none)."""
        return "off" if not slot else "rows+mlp" if slot in self.tables.mlp_slots else "rows"


def _put(a: torch.Tensor, b: torch.Tensor, w: LoraWeights | None) -> None:
    """One adapted linear into a slot's views: a [R, K], b [N, R] or [micros, n, R] (rows as its pack holds
    them); the scale folded into B, a lower rank into the first columns (the rest stays zero)."""
    if w is not None:
        a[:w.rank].copy_(w.a)
        b[..., :w.rank].copy_((w.b * w.scale).view(*b.shape[:-1], w.rank))


def _slice(rows: int | slice) -> slice:
    return rows if isinstance(rows, slice) else slice(rows, rows + 1)


def mode_of(adapters: RowAdapters | None) -> str:
    """The LoRA mode of a forward over these rows (an engine without adapter tables: "off")."""
    return "off" if adapters is None else adapters.mode


def lora_key(mode: str) -> tuple:
    """What a step graph's key adds for its rows' LoRA mode (nothing for "off": the base step's graph)."""
    return () if mode == "off" else (("lora", mode),)


def load_adapter(tables: LoraTables, name: str, folder: str | Path) -> int:
    """Read this rank's slices of the PEFT folder and install them as `name`; returns its slot."""
    return tables.install(name, read_peft(folder, tables.cfg, tables.layout, tables.targets))
