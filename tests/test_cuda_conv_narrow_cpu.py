"""The CUDA narrow-output conv (kernels/cuda_conv_narrow.py, csrc/conv_narrow_sm90.cu) on the CPU: a float64 model of
the kernel's projection and tap sum over its packed weights gives the 3x3 conv, a strip walk with its halo columns
covers every output column once, and the row's rules take only what the kernel does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast.dispatch import Spec
from taesd_fast.kernels import cuda_conv_narrow


def _kernel_model(x: torch.Tensor, wp: torch.Tensor, c_out: int, bias: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: per input row, P = W' h over a strip of 136 input columns starting one
    left of the strip's 128 outputs (zero outside the image, as the TMA fills); output (y, x, o) = bias(o) + the sum
    over taps (r, s) of P_{y - 1 + r}[(3 r + s) c_out + o] at strip column x + s."""
    B, c, H, W = x.shape
    strips = -(-W // cuda_conv_narrow.STRIP)
    xp = F.pad(x.double(), (1, strips * 128 + 8 - W - 1, 1, 1))  # rows -1..H, columns -1..strips * 128 + 6
    p_all = torch.einsum("mc,bchw->bmhw", wp.double(), xp)  # [B, rows of W', H + 2, columns]
    out = torch.zeros(B, c_out, H, strips * 128, dtype=torch.float64)
    for sx in range(strips):
        strip = p_all[..., 128 * sx: 128 * sx + 136]
        for r in range(3):
            for s in range(3):
                rows = strip[:, (3 * r + s) * c_out: (3 * r + s + 1) * c_out, r: r + H, s: s + 128]
                out[..., 128 * sx: 128 * sx + 128] += rows
    return out[..., :W] + bias.double().view(1, -1, 1, 1)


@pytest.mark.parametrize("c_out,H,W", [(3, 5, 7), (12, 4, 130), (3, 3, 256)])
def test_projection_and_tap_sum_give_the_conv(c_out, H, W):
    gen = torch.Generator().manual_seed(c_out * 1000 + W)
    x = torch.randn(2, 64, H, W, generator=gen, dtype=torch.float64)
    w = (torch.randn(c_out, 64, 3, 3, generator=gen, dtype=torch.float64) / 24).half()
    b = torch.randn(c_out, generator=gen, dtype=torch.float64)
    wp = cuda_conv_narrow.pack(w)
    patch = cuda_conv_narrow.PATCHES[c_out]
    assert wp.dtype == torch.float16 and wp.shape == (patch * 64, 64)
    assert not wp[9 * c_out:].any()  # the M block's padding rows
    ref = F.conv2d(x, w.double(), b, padding=1)
    got = _kernel_model(x, wp, c_out, b)
    assert torch.allclose(got, ref, rtol=0, atol=1e-10), (got - ref).abs().max()  # the same f16 weights: exact


def _spec(c_in=64, c_out=3, stride=1, upsample=1, residual=False, pre_clamp=False, relu=False, device="cuda:0"):
    return Spec("conv2d", device, (4, c_in, 320, 512), (c_out, c_in, 3, 3), torch.float16, stride, True, residual,
                relu, "channels_last", upsample, pre_clamp)


@pytest.mark.parametrize("kw,limit", [
    ({"c_in": 128}, "128->3 channels"), ({"c_out": 4}, "64->4 channels"), ({"c_out": 48}, "64->48 channels"),
    ({"upsample": 2}, "conv + bias"), ({"stride": 2}, "conv + bias"), ({"residual": True}, "conv + bias"),
    ({"pre_clamp": True}, "conv + bias"), ({"relu": True}, "conv + bias")])
def test_shape_rule_names_the_limit(kw, limit):
    args = {"c_in": 64, "c_out": 3, "stride": 1, "upsample": 1, "pre_clamp": False, "residual": False,
            "relu": False} | kw
    assert limit in cuda_conv_narrow.shape_reason(**args)
    assert cuda_conv_narrow.shape_reason(64, 12, 1, 1, False, False, False) is None


def test_rule_answers_cpu_without_cuda():
    assert cuda_conv_narrow.spec_unsupported_reason(_spec(device="cpu")) == "CPU tensor"


@pytest.mark.parametrize("shape,dtype,skip,limit", [
    ((2, 3, 3, 64, 64), torch.uint8, 0, "do not hold input"),  # 3 frames a sample, input has 2
    ((2, 2, 3, 32, 64), torch.uint8, 0, "do not hold input"),  # wrong height
    ((2, 1, 3, 64, 64), torch.uint8, 0, "do not hold input"),  # skip 0 leaves 2 frames
    ((2, 2, 3, 64, 64), torch.float32, 0, "frames dtype torch.float32"),
])
def test_frames_rule_names_the_limit(shape, dtype, skip, limit):
    x = torch.zeros(4, 64, 64, 64, dtype=torch.float16)
    w = torch.zeros(3, 64, 3, 3, dtype=torch.float16)
    assert limit in cuda_conv_narrow.frames_reason(x, w, torch.zeros(shape, dtype=dtype), skip)
    assert cuda_conv_narrow.frames_reason(x, w, torch.zeros(2, 1, 3, 64, 64, dtype=torch.uint8), 1) is None
    strided = torch.zeros(2, 2, 3, 64, 128, dtype=torch.uint8)[..., ::2]
    assert "not dense" in cuda_conv_narrow.frames_reason(x, w, strided, 0)
