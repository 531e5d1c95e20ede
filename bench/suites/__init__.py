"""The suites of `python -m bench`, by name. Each module has a docstring (its --help), `DRY` (whether it
has a --dry path: CPU, Triton's interpreter or the reference ops, tiny shapes), `add_arguments(parser)`
and `run(args, out) -> bool` (False: a check failed)."""
from __future__ import annotations

SUITES = {
    "tables": "the seed article's tables for one rank of each 4-GPU plan at the real shapes (compute only)",
    "one-gpu": "the quantized builds on one GPU at the real shapes: memory, prefill, decode, DiT step, a whole request",
    "prefill-host": "the host time of the eager T2I prefill of one hybrid4 rank, stage by stage",
}


def module_name(suite: str) -> str:
    return "bench.suites." + suite.replace("-", "_")
