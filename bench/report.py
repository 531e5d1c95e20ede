"""What a suite run leaves: `$OUT/<name>.json` (the command, the machine, the date, the suite's figures)
and `$OUT/<name>.txt` (what it printed: its progress lines and its tables), written when the run ends,
also when it fails."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def machine() -> dict[str, Any]:
    """The GPU (or the CPU), torch, Triton and CUDA versions: what a figure was measured on."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return dict(device=torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
                gpus=torch.cuda.device_count() if cuda else 0, torch=torch.__version__, triton=triton_version,
                cuda=torch.version.cuda, python=platform.python_version(), cpus=os.cpu_count())


@dataclass(frozen=True)
class Col:
    """A table column: its header, the row's value (a key or a function of the row), its format."""
    header: str
    value: str | Callable[[dict], Any]
    fmt: str = ""

    def cell(self, row: dict) -> str:
        v = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, self.fmt) if self.fmt else str(v)


class Output:
    """A suite's figures (`data`) and its printed text; `write` puts both in the output folder."""

    def __init__(self, name: str, out_dir: Path, argv: Sequence[str], dry: bool):
        self.name, self.out_dir, self.dry = name, Path(out_dir), dry
        self.command = "python -m bench " + " ".join(shlex.quote(a) for a in argv)
        self.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.data: dict[str, Any] = {}
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        """Print a line (flushed: device logs show progress) and keep it for the text file."""
        print(line, flush=True)
        self.lines.append(line)

    def table(self, rows: Sequence[dict], cols: Sequence[Col], title: str = "") -> None:
        """Rows as an aligned plain-text table (numbers right, text left)."""
        cells = [[c.cell(r) for c in cols] for r in rows]
        widths = [max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
        left = [_text_column(rows, c) for c in cols]

        def line(values: Sequence[str]) -> str:
            return "  ".join(v.ljust(w) if lf else v.rjust(w) for v, w, lf in zip(values, widths, left)).rstrip()
        if title:
            self.say()
            self.say(title)
        self.say(line([c.header for c in cols]))
        for row in cells:
            self.say(line(row))

    def write(self, ok: bool) -> tuple[Path, Path]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        meta = dict(suite=self.name, command=self.command, date=self.date, machine=machine(), dry=self.dry,
                    checks_passed=ok)
        js, txt = self.out_dir / f"{self.name}.json", self.out_dir / f"{self.name}.txt"
        js.write_text(json.dumps(dict(meta, **self.data), indent=1, default=_plain) + "\n")
        head = [f"# {self.command}", f"# {meta['machine']['device']}, torch {meta['machine']['torch']}, "
                f"triton {meta['machine']['triton']}, {self.date}{' (dry run)' if self.dry else ''}"]
        txt.write_text("\n".join(head + self.lines) + "\n")
        return js, txt


def _text_column(rows: Sequence[dict], col: Col) -> bool:
    """Whether a column holds text (left-aligned): its values, the missing ones aside, are strings."""
    values = [row.get(col.value) if isinstance(col.value, str) else col.value(row) for row in rows]
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, str) for v in present)


def _plain(v: Any) -> Any:
    """JSON for what json does not know (dtypes, devices, paths, tensors of one value)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return str(v)
