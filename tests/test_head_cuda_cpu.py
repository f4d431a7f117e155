"""CPU checks of row cuda_fused's host side (kernels/cuda_fused.py): its shape rule, its refusals and the operands it
takes. The kernel itself runs in tests/gpu/test_head_fused_gpu.py (sm_90)."""

import pytest
import torch

from taesd_fast import _backend
from taesd_fast.kernels import cuda_fused as hc
from taesd_fast.kernels import head_full_common as common


def test_rings_and_weights_fit_in_shared_memory():
    # 3 taps x 112 x C bf16 stay resident; the rest of sm_90's 227 KB holds 8 KB slots: at least one raw slot, and
    # two activated ones (the MMAs hold one chunk's slot until the next chunk's MMAs are issued; one would deadlock).
    assert hc.ACT_SLOTS >= 2
    for c in (64, 128, 192, 256):
        assert hc._slots(c) - hc.ACT_SLOTS >= 1
        assert hc._smem(c) <= hc.SMEM_LIMIT
        assert hc._defines(c) == {"CHUNKS": c // 64, "SLOTS": hc._slots(c), "ACT_SLOTS": hc.ACT_SLOTS}
    assert hc._slots(256) == 7
    assert hc._slots(64) == hc.MAX_SLOTS


def test_shape_reason(monkeypatch):
    assert "needs an sm_90 GPU" in hc.shape_reason(256, 352, 640, "cpu")
    monkeypatch.setattr(hc, "capability", lambda device: (9, 0))  # as on an H100/H200
    assert hc.shape_reason(256, 352, 640, "cuda:0") is None
    assert "multiple of 64 up to 256" in hc.shape_reason(96, 8, 8, "cuda:0")
    assert "multiple of 64 up to 256" in hc.shape_reason(320, 8, 8, "cuda:0")
    assert "H*W=63 is not a multiple of 8" in hc.shape_reason(256, 9, 7, "cuda:0")
    assert ">= 2**31 elements" in hc.shape_reason(256, 2048, 2048, "cuda:0")
    monkeypatch.setattr(hc, "capability", lambda device: (9, 1))  # an sm_90a cubin runs on 9.0 only
    assert "needs an sm_90 GPU" in hc.shape_reason(256, 352, 640, "cuda:0")


def test_reason_checks_tma_strides_and_failures(monkeypatch):
    monkeypatch.setattr(hc, "shape_reason", lambda *a: None)  # pretend the device and shape are fine
    monkeypatch.setattr(_backend, "kernels_unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(hc, "_failure", [])
    x = torch.randn(2, 64, 6, 4, 8).bfloat16()
    assert hc.unsupported_reason(x, None) is None
    # tma_pdl.frames_tma_reason's cases are in tests/test_head_wgmma_cpu.py; here, that reason consults it.
    shifted = torch.randn(2 * 64 * 6 * 32 + 1).bfloat16()[1:].view(2, 64, 6, 4, 8)  # base 2 bytes off
    assert "cache is not 16-byte aligned" in hc.unsupported_reason(x, shifted[:, :, :2])
    with pytest.warns(RuntimeWarning, match="CUDA head kernel is unavailable .*NVRTC could not compile"):
        hc.give_up(RuntimeError("NVRTC could not compile head_g_sm90.cu for sm_90a"))
    assert "NVRTC could not compile" in hc.unsupported_reason(x, None)


def test_the_row_says_why_it_cannot_run(monkeypatch):
    """The row's g kernel runs or raises naming why: its shape rule, or an earlier compile failure."""
    x = torch.randn(1, 64, 2, 4, 8).bfloat16()
    with pytest.raises(ValueError, match="row 'cuda_fused' cannot run this call: needs an sm_90 GPU"):
        hc.launch_g(x, None, None, None, None, None, 1e-12)
    monkeypatch.setattr(hc, "shape_reason", lambda *a: None)
    monkeypatch.setattr(hc, "_failure", ["RuntimeError: NVRTC could not compile"])
    with pytest.raises(ValueError, match="cannot run this call: RuntimeError: NVRTC could not compile"):
        hc.launch_g(x, None, None, None, None, None, 1e-12)


def test_misaligned_frames_are_copied_not_refused():
    """TMA needs 16-byte aligned frames: a Hopper row copies features and cache that are not, instead of refusing
    the call; aligned ones are passed through untouched."""
    x = torch.randn(2, 64, 6, 4, 8).bfloat16()
    shifted = torch.randn(2 * 64 * 2 * 32 + 1).bfloat16()[1:].view(2, 64, 2, 4, 8)  # base 2 bytes off
    f, c = common.hopper_operands("cuda_fused", None, x, shifted)
    assert f is x and c.data_ptr() % 16 == 0 and torch.equal(c, shifted)
