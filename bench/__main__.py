"""`python -m bench SUITE [options]`: run one benchmark suite; it writes `<suite>.json` (the command, the
machine, the date, the figures) and `<suite>.txt` (its tables) to --out (default $OUT, else ./bench-out).
`python -m bench SUITE --help`: the suite's options."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from .suites import SUITES, module_name


def _suite_list() -> str:
    width = max(map(len, SUITES))
    return "suites:\n" + "\n".join(f"  {name:<{width}}  {what}" for name, what in SUITES.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="python -m bench", description=__doc__, epilog=_suite_list(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("suite", choices=SUITES, metavar="SUITE", help="one of the suites below")
    top.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options (SUITE --help)")
    a = top.parse_args(argv)
    dry = "--dry" in a.options
    if dry:     # before Triton is first imported (the suites import hunyuan_kernels): its interpreter runs the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    suite = importlib.import_module(module_name(a.suite))
    ap = argparse.ArgumentParser(prog=f"python -m bench {a.suite}", description=suite.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench-out"),
                    help="folder for the JSON and the tables (default: $OUT, else ./bench-out)")
    if suite.DRY:
        ap.add_argument("--dry", action="store_true",
                        help="CPU, tiny shapes, Triton's interpreter or the reference ops: checks the suite runs")
    suite.add_arguments(ap)
    args = ap.parse_args(a.options)
    import torch
    needs_cuda = getattr(suite, "needs_cuda", lambda args: getattr(suite, "CUDA", True))   # per run, where a suite says
    if not dry and not torch.cuda.is_available() and needs_cuda(args):
        ap.error("needs a CUDA GPU" + (" (or --dry)" if suite.DRY else ""))
    if dry:
        from hunyuan_kernels._triton import prepare_interpreter
        prepare_interpreter()
    from .report import Output
    out = Output(a.suite, args.out, argv, dry)
    ok = False
    try:
        ok = bool(suite.run(args, out))
    finally:
        js, txt = out.write(ok)
        print(f"wrote {js} and {txt}" + ("" if ok else " (a check failed or the run stopped)"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
