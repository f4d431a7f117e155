"""The CUDA upsample conv's packed weights (kernels/cuda_conv_up.py `pack_classes`) on the CPU: a float64 model of
the kernel's indexing (csrc/conv_up_sm90.cu: per class (group, output phase py, px), four taps of [C_out][C_in])
gives conv3x3(up2(g(x))) within the f16 rounding of the folded weights, and the row's rule takes only what the
kernel does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast.dispatch import Spec
from taesd_fast.kernels import conv_pack, cuda_conv_up


def _kernel_model(x: torch.Tensor, wp: torch.Tensor, groups: int) -> torch.Tensor:
    """What the kernel computes from x [B, 64, H, W] and the packed weights, in float64: output frame
    i * groups + t, pixel (2 y + py, 2 x + px) = the sum over taps (r, s) of W[t, py, px, r, s] applied to x at row
    y + py - 1 + r, column x + px - 1 + s (zero outside the image)."""
    B, c, H, W = x.shape
    xp = F.pad(x.double(), (1, 1, 1, 1))  # the TMA's zero fill
    taps = wp.double().view(groups, 2, 2, 2, 2, c, c)  # [t, py, px, r, s, C_out, C_in]
    out = torch.zeros(B, groups, c, 2 * H, 2 * W, dtype=torch.float64)
    for t in range(groups):
        for py in range(2):
            for px in range(2):
                for r in range(2):
                    for s in range(2):
                        window = xp[:, :, py + r: py + r + H, px + s: px + s + W]
                        out[:, t, :, py::2, px::2] += torch.einsum("oc,bchw->bohw", taps[t, py, px, r, s], window)
    return out.reshape(B * groups, c, 2 * H, 2 * W)


@pytest.mark.parametrize("groups,H,W", [(1, 5, 7), (2, 6, 4)])
def test_packed_classes_give_the_upsample_conv(groups, H, W):
    gen = torch.Generator().manual_seed(groups * 100 + H)
    c = 64
    x = torch.randn(2, c, H, W, generator=gen, dtype=torch.float64)
    w = torch.randn(c, c, 3, 3, generator=gen, dtype=torch.float64) / (3 * c ** 0.5)
    gw = torch.randn(groups * c, c, 1, 1, generator=gen, dtype=torch.float64) / c ** 0.5
    composed = conv_pack.compose_grow(w, gw) if groups > 1 else w.unsqueeze(0)
    wp = cuda_conv_up.pack_classes(composed)
    assert wp.dtype == torch.float16 and wp.shape == (groups * 16 * c, c)
    g = F.conv2d(x, gw).view(2, groups, c, H, W).reshape(2 * groups, c, H, W) if groups > 1 else x
    ref = F.conv2d(F.interpolate(g, scale_factor=2, mode="nearest"), w, padding=1)
    got = _kernel_model(x, wp, groups)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 2e-3, rel  # f16 rounding of the folded weights only; a wrong tap or phase gives O(1)


def _spec(c_in=64, c_out=64, stride=1, upsample=2, residual=False, pre_clamp=False, device="cuda:0"):
    return Spec("conv2d", device, (2, c_in, 160, 256), (c_out, c_in, 3, 3), torch.float16, stride, True, residual,
                True, "channels_last", upsample, pre_clamp)


@pytest.mark.parametrize("kw,limit", [
    ({"c_in": 128}, "128->64 channels"), ({"c_out": 128}, "64->128 channels"), ({"upsample": 1}, "up 2 + conv"),
    ({"stride": 2, "upsample": 1}, "up 2 + conv"), ({"residual": True}, "up 2 + conv"),
    ({"pre_clamp": True}, "up 2 + conv")])
def test_shape_rule_names_the_limit(kw, limit):
    args = {"c_in": 64, "c_out": 64, "stride": 1, "upsample": 2, "pre_clamp": False, "residual": False} | kw
    assert limit in cuda_conv_up.shape_reason(**args)
    assert cuda_conv_up.shape_reason(64, 64, 1, 2, False, False) is None


def test_rule_answers_cpu_without_cuda():
    assert cuda_conv_up.spec_unsupported_reason(_spec(device="cpu")) == "CPU tensor"
