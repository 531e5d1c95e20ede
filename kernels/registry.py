"""Which implementation of each fused op runs: the plain-PyTorch reference (every device, the CPU path)
or a fast backend (Triton, FlashInfer) where it supports the device and dtype.

An op is a name with a reference and any number of backends:

    @reference("rms_norm")
    def rms_norm_ref(x, weight, eps): ...

    @backend("rms_norm", "triton", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16))
    def rms_norm_triton(x, weight, eps): ...

    call("rms_norm", x, weight, eps)          # the chosen implementation for x's device and dtype

The choice depends only on (device type, dtype) of the first tensor argument and on the backends
allowed, never on data, so it is made once per key and cached (no Python work in a hot loop beyond a
dict lookup). `HUNYUAN_KERNELS` (comma-separated backend names, e.g. `torch`) limits the allowed
backends for a process; `allowed(...)` does the same for a block of code (tests and benches compare a
backend with the reference this way, and `chosen` lets a GPU test assert that the fast path ran).
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
    available: Callable[[], bool]        # the backend can run in this process (import worked, ...)

    def fits(self, device: str, dtype: torch.dtype | None) -> bool:
        return ((self.devices is None or device in self.devices)
                and (self.dtypes is None or dtype is None or dtype in self.dtypes))


_IMPLS: dict[str, list[Impl]] = {}
_CACHE: dict[tuple, Impl] = {}
_ALLOWED: list[frozenset[str] | None] = [None]


def _env_allowed() -> frozenset[str] | None:
    v = os.environ.get("HUNYUAN_KERNELS", "").strip()
    return frozenset(s.strip() for s in v.split(",") if s.strip()) | {REFERENCE} if v else None


def _register(op: str, backend: str, devices, dtypes, available) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        impls = _IMPLS.setdefault(op, [])
        if any(i.backend == backend for i in impls):
            raise ValueError(f"kernel op {op!r} already has a {backend!r} implementation")
        impl = Impl(op, backend, fn, tuple(devices) if devices else None, tuple(dtypes) if dtypes else None,
                    available)
        # in registration order (the first registered backend is preferred), the reference last: it is
        # the fallback of every key
        impls.append(impl)
        impls.sort(key=lambda i: i.backend == REFERENCE)
        _CACHE.clear()
        return fn
    return deco


def reference(op: str) -> Callable[[Callable], Callable]:
    """The plain-PyTorch definition of `op`: runs on every device and dtype."""
    return _register(op, REFERENCE, None, None, lambda: True)


def backend(op: str, name: str, devices=("cuda",), dtypes=None,
            available: Callable[[], bool] = lambda: True) -> Callable[[Callable], Callable]:
    """A fast implementation of `op` for some device types and dtypes (checked against the reference
    by the op's GPU test)."""
    if name == REFERENCE:
        raise ValueError("use @reference for the PyTorch definition")
    return _register(op, name, devices, dtypes, available)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def select(op: str, device: torch.device | str, dtype: torch.dtype | None) -> Impl:
    dev = torch.device(device).type
    allowed = _ALLOWED[-1] if _ALLOWED[-1] is not None else _env_allowed()
    key = (op, dev, dtype, allowed)
    impl = _CACHE.get(key)
    if impl is None:
        if op not in _IMPLS:
            raise KeyError(f"unknown kernel op {op!r}")
        for cand in _IMPLS[op]:
            if (allowed is None or cand.backend in allowed) and cand.fits(dev, dtype) and cand.available():
                impl = cand
                break
        if impl is None:
            raise RuntimeError(f"kernel op {op!r} has no reference implementation")
        _CACHE[key] = impl
    return impl


def chosen(op: str, device: torch.device | str, dtype: torch.dtype | None) -> str:
    """The backend name `call` uses for this device and dtype."""
    return select(op, device, dtype).backend


def _needs_grad(args, kwargs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values()))


def call(op: str, *args, **kwargs):
    """Run `op` on the implementation chosen for the first tensor's device and dtype. Where autograd
    records (training), the reference runs: the fast backends define no backward."""
    t = _first_tensor(args, kwargs)
    if _needs_grad(args, kwargs):
        ref = _IMPLS[op][-1]            # sorted: the reference is last
        assert ref.backend == REFERENCE, f"kernel op {op!r} has no reference"
        return ref.fn(*args, **kwargs)
    impl = select(op, t.device if t is not None else "cpu", t.dtype if t is not None else None)
    return impl.fn(*args, **kwargs)


def ops() -> dict[str, list[str]]:
    """Every op and its backends, fastest first (the reference last)."""
    return {op: [i.backend for i in impls] for op, impls in sorted(_IMPLS.items())}


@contextlib.contextmanager
def allowed(*backends: str) -> Iterator[None]:
    """Within the block only these backends (and the reference) are chosen: `allowed()` = reference only."""
    _ALLOWED.append(frozenset(backends) | {REFERENCE})
    try:
        yield
    finally:
        _ALLOWED.pop()
