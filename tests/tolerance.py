"""The tolerance rule for a low-precision attention output, one copy for tests/python and tests/gpu
(both import it as `tolerance`: pytest puts tests/ on sys.path for tests/conftest.py).

FlashAttention's rule: the kernel's max error against the fp64 result `exact` is at most 2x that of
PyTorch's own computation in the same dtype (`low`), plus one rounding of `exact` to the dtype the
kernel returns (the least error any kernel returning that dtype can have) and 1e-5. Without the
rounding term the rule compares two maxima of a few roundings each: CI once read 2.09x on a CPU case
where this machine read at most 1.76x in 340 draws of dout (AMX bf16; 1.21x with the term).
`slack` adds a bound a caller derives for an error source PyTorch's computation does not have (an
accumulation order, a gradient's extra term); it is 0 unless the caller says why."""
from __future__ import annotations

import math

import torch


def low_precision_bound(mine: torch.Tensor, exact: torch.Tensor, low: torch.Tensor, slack: float = 0.0):
    """(err, bound) of the rule; an empty output has no error and the bound of its constant terms."""
    if mine.numel() == 0:
        return 0.0, 1e-5 + slack
    exact = exact.double()
    err = (mine.double() - exact).abs().max().item()
    pt_err = (low.double() - exact).abs().max().item()
    rounding = (exact.to(mine.dtype).double() - exact).abs().max().item()
    return err, 2 * pt_err + rounding + 1e-5 + slack


def assert_within(err: float, bound: float, what: str = ""):
    """The assertion of the rule, for a caller that records (err, bound) first."""
    assert math.isfinite(err), f"{what}: non-finite output"
    assert err <= bound, f"{what}: max err {err:.3e} > bound {bound:.3e}"


def assert_low_precision_rule(mine: torch.Tensor, exact: torch.Tensor, low: torch.Tensor, what: str = "",
                              slack: float = 0.0):
    """Asserts the rule (and a finite error); returns (err, bound)."""
    err, bound = low_precision_bound(mine, exact, low, slack)
    assert_within(err, bound, what)
    return err, bound
