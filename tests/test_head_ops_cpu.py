"""CPU checks of the split head conv's ops and twins (conv_n128 + head_stencil): what runs on CPU."""

import pytest
import torch
import torch.nn.functional as F

from conftest import video_from_channels
from taesd_fast.kernels import head_math
from taesd_fast.kernels import head_stencil as hs
from taesd_fast.kernels import split_bf16 as hk
from taesd_fast.kernels.head_g_layout import GC, pack_weight


def _case(b=1, c_in=16, t=4, h=9, w=11, c_out=12, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c_in, t + 2, h, w, generator=gen)
    wt = torch.randn(c_out, c_in, 3, 3, 3, generator=gen) * (0.6 / (27 * c_in) ** 0.5)
    bias = torch.randn(c_out, generator=gen) * 0.1
    return x.to(dtype), wt.to(dtype), bias.to(dtype)


def _conv_ref(x, wt, bias):
    return F.conv3d(x, wt, bias, padding=(0, 1, 1)).clamp(-1, 1)


@pytest.mark.parametrize("b,t,h,w", [(1, 1, 9, 11), (1, 4, 7, 13), (2, 4, 5, 6), (1, 2, 1, 1)])
def test_twins_compose_to_conv3d(b, t, h, w):
    x, wt, bias = _case(b=b, t=t, h=h, w=w)
    g = hk.conv_n128_ref(x, pack_weight(wt))
    assert g.shape == (b, t, h, w, GC)
    out = hs.head_stencil_ref(g, bias, t, 0, h, h, 0)
    assert out.shape == (b, 12, t, h, w) and out.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(out, _conv_ref(x, wt, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["ncdhw", "cl3d", "band"])
def test_cuda_conv_n128_forms_equal_twin(layout):
    # The two CUDA forms of conv_n128 (cuBLAS Toeplitz GEMM for NCDHW x, cuDNN for channels-last x) are
    # plain PyTorch calls, so their math and output strides can be checked here in fp32.
    x, wt, _ = _case(b=2, t=4, h=7, w=6, seed=11)
    if layout == "cl3d":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "band":
        x = x[:, :, :, 2:5]  # a row slice of NCDHW x: still one strided matrix, no copy
    wp = pack_weight(wt)
    ref = hk.conv_n128_ref(x, wp)
    got = hk._conv_n128_cudnn(x, wp) if layout == "cl3d" else hk._conv_n128_gemm(x, wp)
    assert hk._gemm_ok(x) == (layout != "cl3d")
    assert got.stride() == ref.stride() == hk._conv_n128_fake(x, wp).stride()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_toeplitz_weight():
    _, wt, _ = _case(c_in=3)
    wp = pack_weight(wt)
    tw = hk.toeplitz_weight(wp, 2).view(3, 4, 2, GC)  # [c, s, t, n]
    for t in range(2):
        for s in range(4):
            want = wp[:, :, s - t, 0, 0].t() if 0 <= s - t < 3 else torch.zeros(3, GC)
            assert torch.equal(tw[:, s, t], want)


@pytest.mark.parametrize("layout", ["ncdhw", "cl3d"])
def test_split_head_conv_equals_conv3d(layout):
    x, wt, bias = _case(b=2, t=3, h=10, w=7, seed=1)
    if layout == "cl3d":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(hk.split_head_conv(x, wt, bias), _conv_ref(x, wt, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hk.split_head_conv(x, wt, None), _conv_ref(x, wt, None), rtol=1e-5, atol=1e-5)


def test_output_actually_clamps():
    x, wt, bias = _case(seed=2)
    out = hk.split_head_conv(x, wt * 20, bias)
    assert out.abs().max() == 1 and (out.abs() < 1).any()


@pytest.mark.parametrize("band_rows", [1, 2, 3, 4, 8, 100])
def test_banded_equals_full(band_rows):
    x, wt, bias = _case(b=2, t=2, h=9, w=6, seed=3)
    full = hk.split_head_conv(x, wt, bias)
    assert torch.equal(hk.split_head_conv(x, wt, bias, band_rows=band_rows), full)


@pytest.mark.parametrize("g_off", [1, 2])
def test_band_stencil_from_slice_of_full_g(g_off):
    # Each band, computed from a slice of the full g that carries g_off halo rows, equals its rows of the full frame.
    x, wt, bias = _case(t=2, h=11, w=5, seed=4)
    g = hk.conv_n128_ref(x, pack_weight(wt))
    full = hs.head_stencil_ref(g, bias, 2, 0, 11, 11, 0)
    for lo, rows in [(0, 3), (3, 4), (7, 4), (0, 11), (5, 1), (10, 1)]:
        sl = g[:, :, max(lo - g_off, 0): min(lo + rows + g_off, 11)]
        band = hs.head_stencil(sl, bias, 2, lo, rows, 11, g_off)
        assert torch.equal(band, full[:, :, :, lo: lo + rows])


def test_g_rows_are_clipped_at_the_image_border():
    # g never carries rows outside the image: they are the conv's zero padding, not data.
    x, wt, bias = _case(t=1, h=6, w=4, seed=5)
    g = hk.conv_n128_ref(x, pack_weight(wt))
    g_pad = torch.cat([torch.full_like(g[:, :, :1], float("nan")), g], dim=2)  # an extra row above row 0 ...
    with pytest.raises(ValueError):  # ... is the wrong height for this band: g holds rows clipped to the image
        hs.head_stencil(g_pad, bias, 1, 0, 6, 6, 1)


def test_wrong_depth_or_height_raises():
    x, wt, bias = _case(t=4, h=8, w=5)
    g = hk.conv_n128_ref(x, pack_weight(wt))  # [1, 4, 8, 5, 112]
    with pytest.raises(ValueError, match=r"T=3.*got \(1, 4, 8, 5, 112\)"):
        hs.head_stencil(g, bias, 3, 0, 8, 8, 0)
    with pytest.raises(ValueError, match=r"rows_g=8.*got \(1, 4, 7, 5, 112\)"):
        hs.head_stencil(g[:, :, :7], bias, 4, 0, 8, 8, 0)
    with pytest.raises(ValueError, match="rows_g=5"):  # band [2, 5) with g_off=1 needs global rows [1, 6)
        hs.head_stencil(g[:, :, 1:5], bias, 4, 2, 3, 8, 1)
    with pytest.raises(ValueError, match="g_off >= 1"):
        hs.head_stencil(g[:, :, 2:5], bias, 4, 2, 3, 8, 0)
    with pytest.raises(ValueError, match=r"\[B, T, rows_g, W, GC\]"):
        hs.head_stencil(g[0], bias, 4, 0, 8, 8, 0)
    with pytest.raises(ValueError, match="not inside"):
        hs.head_stencil(g, bias, 4, 4, 5, 8, 1)
    with pytest.raises(ValueError, match="channels"):
        hs.head_stencil(g[..., :100], bias, 4, 0, 8, 8, 0)
    with pytest.raises(ValueError, match="T\\+2 >= 3"):
        hk.conv_n128(x[:, :, :2], pack_weight(wt))
    with pytest.raises(ValueError, match="w_packed"):
        hk.conv_n128(x, wt)


@pytest.mark.parametrize("band_rows", [None, 1, 4])
@pytest.mark.parametrize("patch", [1, 2])
def test_patch_gives_the_unpatchified_video(patch, band_rows):
    # The stencil's video layout, whole and in row bands, against the channel-by-channel unpatchify of its output.
    x, wt, bias = _case(b=2, t=2, h=9, w=6, seed=6)
    want = video_from_channels(hk.split_head_conv(x, wt, bias), patch)
    got = hk.split_head_conv(x, wt, bias, band_rows=band_rows, patch=patch)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(head_math.unpatchify(hk.split_head_conv(x, wt, bias), patch), want)


def test_patch_must_divide_the_channels():
    x, wt, bias = _case(t=1, h=4, w=5)
    g = hk.conv_n128_ref(x, pack_weight(wt))
    with pytest.raises(ValueError, match="C_out=12 divisible by p\\*p, got 3"):
        hs.head_stencil(g, bias, 1, 0, 4, 4, 0, 3)
    with pytest.raises(ValueError, match="got -1"):
        hs.head_stencil(g, bias, 1, 0, 4, 4, 0, -1)


def test_pack_weight_layout():
    _, wt, _ = _case(c_in=5)
    wp = pack_weight(wt)
    assert wp.shape == (GC, 5, 3, 1, 1)
    for i in range(3):
        for j in range(3):
            assert torch.equal(wp[(i * 3 + j) * 12: (i * 3 + j + 1) * 12, :, :, 0, 0], wt[:, :, :, i, j])
    assert not wp[108:].any()


def test_weight_cache_sees_in_place_updates():
    x, wt, bias = _case(seed=6)
    a = hk.split_head_conv(x, wt, bias)
    with torch.no_grad():
        wt.mul_(-1)  # bumps the version counter
    torch.testing.assert_close(hk.split_head_conv(x, wt, bias), _conv_ref(x, wt, bias), rtol=1e-5, atol=1e-5)
    assert not torch.equal(a, hk.split_head_conv(x, wt, bias))


def test_bf16_twin_path_runs():
    x, wt, bias = _case(dtype=torch.bfloat16, seed=7)
    out = hk.split_head_conv(x, wt, bias)
    assert out.dtype == torch.bfloat16
    ref = _conv_ref(x.float(), wt.float(), bias.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_opcheck_cpu():
    x, wt, bias = _case(t=2, h=5, w=4, seed=8)
    wp = pack_weight(wt)
    torch.library.opcheck(hk.conv_n128, (x, wp))
    g = hk.conv_n128(x, wp)
    torch.library.opcheck(hk.conv_n128, (x.contiguous(memory_format=torch.channels_last_3d), wp))
    torch.library.opcheck(hs.head_stencil, (g, bias, 2, 0, 5, 5, 0))
    torch.library.opcheck(hs.head_stencil, (g[:, :, 1:5], bias, 2, 2, 2, 5, 1))
    torch.library.opcheck(hs.head_stencil, (g[:, :, 1:5], bias, 2, 2, 2, 5, 1, 2))


def test_traces_without_graph_breaks():
    x, wt, bias = _case(t=2, h=6, w=5, seed=9)
    f = torch.compile(hk.split_head_conv, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x, wt, bias), hk.split_head_conv(x, wt, bias))
    torch.testing.assert_close(f(x, wt, bias, band_rows=4), hk.split_head_conv(x, wt, bias))


def test_fp32_reduction_flag_is_restored():
    m = torch.backends.cuda.matmul
    before = m.allow_bf16_reduced_precision_reduction
    with hk._fp32_reduction():
        assert m.allow_bf16_reduced_precision_reduction is False
    assert m.allow_bf16_reduced_precision_reduction == before
