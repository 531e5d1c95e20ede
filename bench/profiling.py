"""Where a call's time goes, as the suites print it (torch.profiler)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from .timing import sync


# kernel names of separate conversion passes: ours (_dequant_kernel, _quantize_rows_kernel, ...) and humming's
# input kernel (process_input: per-row FP8 quantization, SwiGLU + quantization)
CONVERSIONS = ("dequant", "quantize", "process_input")


def kernel_table(fn: Callable[[], object], label: str, rows: int = 24) -> list[str]:
    """The CUDA kernels of one call of `fn` by total time (where a stage's time goes), then the operators
    that launched them by the CUDA time of their own kernels (which op an elementwise kernel belongs to).
    One warm-up call first."""
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        sync()
    events = p.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == cuda]
    ops = [e for e in events if e.device_type != cuda and e.self_device_time_total > 0]
    out = [f"profile: {label}"]
    # what issue 41 wants gone from a step: separate passes that (de)quantize weights or activations
    conv = [e for e in kernels if any(w in e.key.lower() for w in CONVERSIONS)]
    names = ", ".join(sorted({e.key[:40] for e in conv})) or "none"
    out.append(f"dequantize / quantize kernels: {sum(e.count for e in conv)} launches, "
               f"{sum(e.device_time_total for e in conv) / 1e3:.1f} ms ({names})")
    for title, evs, key in (("kernels", kernels, "device_time_total"),
                            ("operators (self CUDA time)", ops, "self_device_time_total")):
        out.append(f"{title}: {sum(getattr(e, key) for e in evs) / 1e3:.1f} ms in all")
        for e in sorted(evs, key=lambda e: getattr(e, key), reverse=True)[:rows]:
            out.append(f"  {getattr(e, key) / 1e3:9.3f} ms {e.count:5d}x  {e.key[:90]}")
    return out


def op_table(fn: Callable[[], object], sort_by: str, rows: int = 20, calls: int = 1,
             cuda: bool | None = None) -> list[str]:
    """torch.profiler's operator table of `calls` calls of `fn` (after one warm-up call), sorted by
    `sort_by` (e.g. "cuda_time_total", "self_cpu_time_total"); CUDA activity where there is a GPU."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        for _ in range(calls):
            fn()
        sync()
    return p.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60).splitlines()
