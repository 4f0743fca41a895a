"""Pick an op's implementation once, checked against its reference on the serving device.

The device proposes candidates, fastest first, ending with the torch reference (the oracle, never
checked against itself). Each fast candidate runs a small problem of the model's real shapes; one that
raises, or whose result differs from the reference's beyond the op's tolerance, is skipped with a
warning that names it, and the next is tried. The choice and the reasons go to the start-up log,
/metrics and `xpulora check-device`.

Fault injection (to test this fallback, and to see what a user with a broken driver would see):
XPULORA_KERNEL_FAULT="OP=MODE[,OP=MODE]" with MODE `wrong` (the candidate's check result is perturbed)
or `raise` (its check raises). It applies to every non-reference candidate of OP, only inside these
checks: a candidate that passes is served unchanged, and a faulted one is never served.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

REFERENCE = "reference"
FAULT_ENV = "XPULORA_KERNEL_FAULT"
Fault = Literal["wrong", "raise"]
Result = torch.Tensor | Mapping[str, torch.Tensor]
"""A check problem's result: one tensor, or named parts (each compared with the reference's part of that
name, so a small part's error is not hidden by a large part's scale)."""


@dataclass(frozen=True)
class Choice:
    op: str
    chosen: str
    rejected: tuple[tuple[str, str], ...]
    """(candidate, why) for every faster candidate that failed its check."""
    checked: bool
    """Whether the chosen implementation was checked (False for the reference itself)."""


def fault_for(op: str) -> Fault | None:
    """The fault XPULORA_KERNEL_FAULT injects into op's checks, if any."""
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, _, mode = item.partition("=")
        if mode not in ("wrong", "raise"):
            raise ValueError(f"{FAULT_ENV}: {item!r}: expected OP=wrong or OP=raise")
        if name.strip() == op:
            return mode  # type: ignore[return-value]
    return None


def mismatch(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> str | None:
    """Why got differs from want beyond (rtol, atol relative to max|want|), or None."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    if not bool(torch.isfinite(g).all()):
        return "non-finite values"
    rtol, atol = tol
    scale = float(w.abs().max()) if w.numel() else 0.0
    err = (g - w).abs()
    bound = atol * max(scale, 1e-6) + rtol * w.abs()
    if bool((err > bound).any()):
        return f"max abs error {float(err.max()):.3g} over tolerance (rtol {rtol}, atol {atol} x {scale:.3g})"
    return None


def _parts_mismatch(got: Result, want: Result, tol: tuple[float, float]) -> str | None:
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        return mismatch(got, want, tol)
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        raise TypeError("a candidate and the reference must both return one tensor or both named parts")
    for part, g in got.items():
        if part not in want:
            raise KeyError(f"the reference has no part {part!r}")
        why = mismatch(g, want[part], tol)
        if why is not None:
            return f"{part}: {why}"
    return None


def _perturb(got: Result) -> Result:
    if isinstance(got, torch.Tensor):
        return got + got.abs().max().clamp(min=1.0)
    return {part: _perturb(g) for part, g in got.items()}  # type: ignore[misc]


def choose(op: str, candidates: Sequence[str], run: Callable[[str], Result],
           tol: tuple[float, float]) -> Choice:
    """The first candidate whose run(name) matches run("reference") within tol; candidates must end with
    the reference. run(name) computes the op's check problem with that implementation."""
    if not candidates or candidates[-1] != REFERENCE:
        raise ValueError(f"{op}: candidates {list(candidates)} must end with {REFERENCE!r}")
    fault = fault_for(op)
    rejected: list[tuple[str, str]] = []
    want: Result | None = None
    for name in candidates[:-1]:
        try:
            if fault == "raise":
                raise RuntimeError(f"fault injected by {FAULT_ENV}")
            got = run(name)
            if fault == "wrong":
                got = _perturb(got)
            if want is None:
                want = run(REFERENCE)
            why = _parts_mismatch(got, want, tol)
        except Exception as e:  # any failure of a fast path means: do not serve with it
            why = f"raised {type(e).__name__}: {e}"
        if why is None:
            log.info("kernels: %s uses %s (checked against the reference)", op, name)
            return Choice(op, name, tuple(rejected), True)
        log.warning("kernels: %s implementation %r failed its start-up check (%s); trying the next one", op, name, why)
        rejected.append((name, why))
    log.info("kernels: %s uses the torch reference", op)
    return Choice(op, REFERENCE, tuple(rejected), False)
