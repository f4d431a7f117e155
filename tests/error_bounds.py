"""The element-wise half of the tests' error bound: a kernel's worst element against the float64 reference must be
within 2x the worst element of PyTorch's own low-precision run of the same call, plus four f16 steps at the
largest output (the slack for outputs where PyTorch's rounding happens to be exact). The relative (L2) bound the
tests also apply barely moves when a kernel gets a few elements wrong in some launches; this one does."""

from __future__ import annotations

import torch


def assert_worst_element_within(out: torch.Tensor, low: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    ref = ref.double()
    worst = (out.double() - ref).abs().max().item()
    low_worst = (low.double() - ref).abs().max().item()
    bound = 2 * low_worst + ref.abs().max().item() * 2.0**-8
    assert worst <= bound, f"{what}max abs err {worst:.3g} > {bound:.3g} (PyTorch's own: {low_worst:.3g})"
