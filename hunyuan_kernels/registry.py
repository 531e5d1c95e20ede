"""Which implementation of each fused op runs: the plain-PyTorch reference (every device, the CPU path)
or a fast variant (a Triton kernel, a cuBLAS call, FlashInfer) where it supports the device, the dtype and
the arguments' shapes.

An op is a name with a reference and any number of variants:

    @reference("rms_norm")
    def rms_norm_ref(x, weight, eps): ...

    @backend("rms_norm", "triton", devices=("cuda",), dtypes=(torch.bfloat16,), fits=lambda x, w, eps: ...)
    def rms_norm_triton(x, weight, eps): ...

    call("rms_norm", x, weight, eps)          # the first variant that fits, else the reference
    chosen("rms_norm")                        # the name of the variant that ran in the last call

The candidates of a call depend only on (device type, dtype) of the first tensor argument and on the
variants allowed, so they are listed once per key and cached. A variant's `fits(*args)` then decides on
host-known shapes, layouts and options only, never on data (no device read, no Python branching on
values inside a hot loop). Variants are tried in registration order; the reference fits everything and
comes last. A variant never falls back by itself: `fits` is where it says what it does not take, so
`chosen` always names the function that ran.

`HUNYUAN_KERNELS` (comma-separated variant names, e.g. `torch`) limits the allowed variants for a process;
`allowed(...)` does the same for a block of code (tests and benches compare a variant with the reference
this way; a bench registers its ablations as variants of their own with `backend` and selects them so).
This package imports nothing of `engine`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

REFERENCE = "torch"


@dataclass(frozen=True)
class Impl:
    op: str
    backend: str
    fn: Callable
    devices: tuple[str, ...] | None      # None: every device type
    dtypes: tuple[torch.dtype, ...] | None
    available: Callable[[], bool]        # the variant can run in this process (its import worked, ...)
    fits: Callable[..., bool] | None     # takes these arguments (host-known shapes only); None: any

    def serves(self, device: str, dtype: torch.dtype | None) -> bool:
        return ((self.devices is None or device in self.devices)
                and (self.dtypes is None or dtype is None or dtype in self.dtypes))


_IMPLS: dict[str, list[Impl]] = {}
_CACHE: dict[tuple, tuple[Impl, ...]] = {}
_ALLOWED: list[frozenset[str] | None] = [None]
_RAN: dict[str, str] = {}                # op -> the variant that ran in its last call


def _env_allowed() -> frozenset[str] | None:
    v = os.environ.get("HUNYUAN_KERNELS", "").strip()
    return frozenset(s.strip() for s in v.split(",") if s.strip()) | {REFERENCE} if v else None


def _register(op: str, backend: str, devices, dtypes, available, fits) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        impls = _IMPLS.setdefault(op, [])
        if any(i.backend == backend for i in impls):
            raise ValueError(f"kernel op {op!r} already has a {backend!r} implementation")
        impl = Impl(op, backend, fn, tuple(devices) if devices else None, tuple(dtypes) if dtypes else None,
                    available, fits)
        # in registration order (the first registered variant is preferred), the reference last: it is
        # the fallback of every call
        impls.append(impl)
        impls.sort(key=lambda i: i.backend == REFERENCE)
        _CACHE.clear()
        return fn
    return deco


def reference(op: str) -> Callable[[Callable], Callable]:
    """The plain-PyTorch definition of `op`: runs on every device and dtype, takes every argument."""
    return _register(op, REFERENCE, None, None, lambda: True, None)


def backend(op: str, name: str, devices=("cuda",), dtypes=None, available: Callable[[], bool] = lambda: True,
            fits: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """A fast variant of `op` for some device types and dtypes, for the arguments `fits` accepts
    (checked against the reference by the op's GPU test)."""
    if name == REFERENCE:
        raise ValueError("use @reference for the PyTorch definition")
    return _register(op, name, devices, dtypes, available, fits)


def unregister(op: str, name: str) -> None:
    """Drop a variant (a bench's ablation, once measured)."""
    _IMPLS[op] = [i for i in _IMPLS[op] if i.backend != name]
    _CACHE.clear()


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def candidates(op: str, device: torch.device | str, dtype: torch.dtype | None) -> tuple[Impl, ...]:
    """The variants a call of `op` on this device and dtype tries, in order (the reference last)."""
    dev = torch.device(device).type
    allowed = _ALLOWED[-1] if _ALLOWED[-1] is not None else _env_allowed()
    key = (op, dev, dtype, allowed)
    found = _CACHE.get(key)
    if found is None:
        if op not in _IMPLS:
            raise KeyError(f"unknown kernel op {op!r}")
        found = tuple(i for i in _IMPLS[op]
                      if (allowed is None or i.backend in allowed) and i.serves(dev, dtype) and i.available())
        if not found or found[-1].backend != REFERENCE:
            raise RuntimeError(f"kernel op {op!r} has no reference implementation")
        _CACHE[key] = found
    return found


def _needs_grad(args, kwargs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values()))


def call(op: str, *args, **kwargs):
    """Run `op` on the first candidate that fits the arguments. Where autograd records (training), the
    reference runs: the fast variants define no backward."""
    if _needs_grad(args, kwargs):
        impl = _IMPLS[op][-1]            # sorted: the reference is last
    else:
        t = _first_tensor(args, kwargs)
        for impl in candidates(op, t.device if t is not None else "cpu", t.dtype if t is not None else None):
            if impl.fits is None or impl.fits(*args, **kwargs):
                break
    _RAN[op] = impl.backend
    return impl.fn(*args, **kwargs)


def chosen(op: str) -> str | None:
    """The variant that ran in the last call of `op` in this process (None: not called yet). A GPU test
    asserts the fast path ran with it."""
    return _RAN.get(op)


def ops() -> dict[str, list[str]]:
    """Every op and its variants, preferred first (the reference last)."""
    return {op: [i.backend for i in impls] for op, impls in sorted(_IMPLS.items())}


@contextlib.contextmanager
def allowed(*backends: str) -> Iterator[None]:
    """Within the block only these variants (and the reference) are chosen: `allowed()` = reference only."""
    _ALLOWED.append(frozenset(backends) | {REFERENCE})
    try:
        yield
    finally:
        _ALLOWED.pop()
