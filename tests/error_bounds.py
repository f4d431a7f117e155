"""The tests' error bounds. The element-wise half: a kernel's worst element against the float64 reference must be
within 2x the worst element of PyTorch's own low-precision run of the same call, plus four f16 steps at the
largest output (the slack for outputs where PyTorch's rounding happens to be exact). The relative (L2) bound the
tests also apply barely moves when a kernel gets a few elements wrong in some launches; this one does.
`assert_conv_within` applies both to a conv row's output."""

from __future__ import annotations

import torch

from taesd_fast.kernels import conv_contract


def assert_worst_element_within(out: torch.Tensor, low: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    ref = ref.double()
    worst = (out.double() - ref).abs().max().item()
    low_worst = (low.double() - ref).abs().max().item()
    bound = 2 * low_worst + ref.abs().max().item() * 2.0**-8
    assert worst <= bound, f"{what}max abs err {worst:.3g} > {bound:.3g} (PyTorch's own: {low_worst:.3g})"


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def assert_conv_within(y: torch.Tensor, args: tuple) -> None:
    """A conv row's f16 output y for conv_contract's args (x, w, b, residual, stride, relu, upsample, pre_clamp):
    every element written (the tests poison outputs with NaN), rel err vs float64 <= 2x that of cuDNN f16 run op by
    op (what the model runs without our kernels), and the worst element within assert_worst_element_within."""
    ref = conv_contract.conv3x3_math(*args, dtype=torch.float64)
    assert y.shape == ref.shape and y.dtype == torch.float16
    assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
    low = conv_contract.conv3x3_math(*args)
    err, torch_err = rel_err(y, ref), rel_err(low, ref)
    assert err <= 2 * torch_err + 1e-7, f"rel err {err:.3g} > 2 x cuDNN f16 error {torch_err:.3g}"
    assert_worst_element_within(y, low, ref)
