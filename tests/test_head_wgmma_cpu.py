"""CPU checks of row gluon_fused's host side (kernels/gluon_fused.py): its shape rule, the TMA views and descriptors,
its refusals, the transposed weight. The kernel itself runs in tests/gpu/test_head_fused_gpu.py (sm_90)."""

import pytest
import torch

from taesd_fast.kernels import gluon_fused as hw
from taesd_fast.kernels import head_full_common as common
from taesd_fast.kernels.head_g_layout import GC, pack_weight
from taesd_fast.kernels.tma_pdl import frames_tma_reason

pytestmark = pytest.mark.skipif(hw._GLUON_ERROR is not None, reason=f"no Gluon: {hw._GLUON_ERROR}")


def test_ring_fits_beside_the_weights():
    # 3 taps x 112 x C bf16 stay resident; the rest of sm_90's 227 KB holds 8 KB slots, at least a frame plus one.
    for c in (64, 128, 256):
        slots = hw._slots(c)
        assert slots >= c // 64 + 1
        assert 3 * hw.G * c * 2 + slots * 64 * 64 * 2 + 1024 <= hw.SMEM_BYTES
    assert hw._slots(256) == 7


def test_shape_reason_on_cpu():
    assert "needs an sm_90 GPU" in hw.shape_reason(256, 4, 352, 640, "cpu")
    assert "needs an sm_90 GPU" in hw.shape_reason(256, 4, 9, 7, "cpu")  # the device is checked first


def test_shape_reason_names_the_limit(monkeypatch):
    monkeypatch.setattr(hw, "is_sm90", lambda device: True)  # as on an H100/H200
    assert hw.shape_reason(256, 4, 352, 640, "cuda:0") is None
    assert "multiple of 64 up to 256" in hw.shape_reason(96, 4, 8, 8, "cuda:0")
    assert "multiple of 64 up to 256" in hw.shape_reason(512, 4, 8, 8, "cuda:0")
    assert "T=17 > 16" in hw.shape_reason(256, 17, 8, 8, "cuda:0")
    assert "H*W=63 is not a multiple of 8" in hw.shape_reason(256, 4, 9, 7, "cuda:0")
    monkeypatch.setattr(hw, "is_sm90", lambda device: False)
    assert "needs an sm_90 GPU" in hw.shape_reason(256, 4, 352, 640, "cuda:0")


def test_tma_alignment_reason():
    # Both Hopper head kernels (this one and cuda_fused's) load the frames as TMA boxes through this check.
    x = torch.randn(2, 64, 6, 4, 8).bfloat16()
    assert frames_tma_reason(x, None) is None
    assert frames_tma_reason(x[:, :, 2:], x[:, :, :2]) is None  # frame slices keep 16-byte strides
    # a channel stride of 193 elements (386 bytes) cannot be a TMA stride
    uneven = torch.randn(2 * 65 * 193).bfloat16().as_strided((2, 64, 6, 4, 8), (65 * 193, 193, 32, 8, 1))
    assert "features is not 16-byte aligned in every stride" in frames_tma_reason(uneven, None)
    shifted = torch.randn(2 * 64 * 6 * 32 + 1).bfloat16()[1:].view(2, 64, 6, 4, 8)  # base 2 bytes off
    assert "features is not 16-byte aligned" in frames_tma_reason(shifted, None)
    assert "cache is not 16-byte aligned" in frames_tma_reason(x, shifted[:, :, :2])


def test_unsupported_reason_checks_tma_strides(monkeypatch):
    monkeypatch.setattr(hw, "shape_reason", lambda *a: None)  # pretend the device and shape are fine
    x = torch.randn(2, 64, 6, 4, 8).bfloat16()
    assert hw.unsupported_reason(x, None) is None
    shifted = torch.randn(2 * 64 * 6 * 32 + 1).bfloat16()[1:].view(2, 64, 6, 4, 8)  # base 2 bytes off
    assert "cache is not 16-byte aligned" in hw.unsupported_reason(x, shifted[:, :, :2])


def test_frames_layout_gives_size_one_dims_dense_strides():
    # The TMA view of both Hopper head kernels (cuda_fused's descriptors take it innermost first).
    x = torch.zeros(1, 256, 4, 8, 16, dtype=torch.bfloat16)
    shape, strides = hw.frames_layout(x[:, :, 1:2], 1)  # T = 1 and B = 1: torch may give those dims any stride
    assert shape == [1, 256, 1, 128]
    assert strides == [256 * 512, 512, 128, 1]  # the channel stride is real (4 frames of 128 pixels)
    shape, strides = hw.frames_layout(torch.zeros(2, 64, 3, 4, 8)[:, :, 1:], 2)  # a frame slice keeps its strides
    assert shape == [2, 64, 2, 32] and strides == [64 * 96, 96, 32, 1]


def test_descriptor_boxes():
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    x = torch.zeros(1, 256, 4, 8, 16, dtype=torch.bfloat16)
    d = hw._desc(x[:, :, 1:2], 1, layout)
    assert (list(d.shape), list(d.strides)) == hw.frames_layout(x[:, :, 1:2], 1)
    assert list(d.block_shape) == [1, 64, 1, 64]


def test_the_row_says_why_it_cannot_run():
    features = torch.randn(1, 256, 2, 8, 8).bfloat16()
    with pytest.raises(ValueError, match="row 'gluon_fused' cannot run this call: needs an sm_90 GPU"):
        hw.launch_g(features, None, None, None, None, None, 1e-12)


def test_transposed_taps_are_the_packed_weight():
    # W^T[k, n, cin] = pack_weight(weight)[n, cin, k]: tap k of g column n (9 spatial taps x 12 outputs).
    weight = torch.randn(12, 64, 3, 3, 3)
    wt = common.pack_weight_taps_t(weight)
    assert wt.shape == (3, GC, 64) and wt.dtype == torch.bfloat16 and wt.is_contiguous()
    packed = pack_weight(weight).reshape(-1, 64, 3)[:GC]
    assert torch.equal(wt, packed.permute(2, 0, 1).bfloat16())
