"""GPU checks of the split head conv (conv_n128 + head_stencil) against fp32 references and its twins.

Tolerance: relative error (||out - ref|| / ||ref||) at most 2x PyTorch's own bf16 F.conv3d error on the same inputs.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import video_from_channels
from taesd_fast import _backend
from taesd_fast.kernels import head_stencil as hs
from taesd_fast.kernels import split_bf16 as hk
from taesd_fast.kernels.head_g_layout import pack_weight


def _unavailable() -> str | None:
    return _backend.kernels_unavailable_reason()  # CPU build / no device / NVRTC failure: never touches CUDA on CPU


pytestmark = [
    pytest.mark.skipif(_unavailable() is not None, reason=f"head kernels unavailable: {_unavailable()}"),
    pytest.mark.usefixtures("no_tf32"),  # fp32 references must not run in TF32
]

CL3D = torch.channels_last_3d




def _case(b=1, t=4, h=37, w=53, c_in=256, c_out=12, seed=0, layout="ncdhw"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # Post-SiLU-like features; weights scaled so outputs mostly lie inside the clamp.
    x = F.silu(torch.randn(b, c_in, t + 2, h, w, device="cuda", generator=gen)).bfloat16()
    wt = (torch.randn(c_out, c_in, 3, 3, 3, device="cuda", generator=gen) * (0.6 / (27 * c_in) ** 0.5)).bfloat16()
    bias = (torch.randn(c_out, device="cuda", generator=gen) * 0.1).bfloat16()
    if layout == "cl3d":
        x = x.contiguous(memory_format=CL3D)
    return x, wt, bias


def _ref(x, wt, bias):
    return F.conv3d(x.float(), wt.float(), bias.float(), padding=(0, 1, 1)).clamp(-1, 1)


def _rel(out, ref):
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    return ((out.float() - ref).norm() / ref.norm()).item()


def _torch_bf16_err(x, wt, bias, ref):
    return _rel(F.conv3d(x, wt, bias, padding=(0, 1, 1)).clamp(-1, 1), ref)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))  # keeps like's strides


@pytest.mark.parametrize("patch", [0, 1, 2])
@pytest.mark.parametrize("g_layout", ["pixel_major", "dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,t,h,w", [(1, 1, 37, 53), (1, 4, 37, 53), (2, 4, 8, 40), (1, 2, 1, 1)])
def test_stencil_kernel_equals_twin(g_layout, dtype, b, t, h, w, patch):
    x, wt, bias = _case(b=b, t=t, h=h, w=w, seed=1)
    g = hk.conv_n128_ref(x.float(), pack_weight(wt)).to(dtype)  # fresh random g, pixel-major like the GEMM's
    if g_layout == "dense":
        g = g.contiguous()
    ref = hs.head_stencil_ref(g, bias, t, 0, h, h, 0, patch)
    out = _poisoned(ref)
    hs.launch_head_stencil(g, bias.float(), out, 0, h, 0, patch)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max().item()}"  # same tap order
    if patch:  # the video layout, against the channel-by-channel unpatchify of the plain kernel's output
        plain = hs.head_stencil(g, bias.float(), t, 0, h, h, 0)
        assert out.is_contiguous() and torch.equal(out, video_from_channels(plain, patch))


@pytest.mark.parametrize("patch", [0, 2])
@pytest.mark.parametrize("layout", ["ncdhw", "cl3d"])
@pytest.mark.parametrize("g_off", [1, 3])
def test_stencil_bands_from_slices_equal_full(layout, g_off, patch):
    t, h, w = 4, 37, 53
    p = max(patch, 1)
    x, wt, bias = _case(t=t, h=h, w=w, seed=2, layout=layout)
    g = hk.conv_n128(x, pack_weight(wt))  # ncdhw: GEMM form, pixel-major g; cl3d: cuDNN, dense g
    full = hs.head_stencil(g, bias.float(), t, 0, h, h, 0, patch)
    for lo, rows in [(0, 5), (5, 16), (21, 16), (36, 1), (0, 37), (17, 1)]:
        a, b = max(lo - g_off, 0), min(lo + rows + g_off, h)
        want = full[:, :, :, lo * p: (lo + rows) * p]
        band = _poisoned(want.contiguous() if patch else want.contiguous(memory_format=CL3D))
        hs.launch_head_stencil(g[:, :, a:b], bias.float(), band, lo, h, a, patch)  # a strided slice of g
        assert torch.equal(band, want), (lo, rows)


@pytest.mark.parametrize("layout", ["ncdhw", "cl3d"])
@pytest.mark.parametrize("b,t,h,w", [(1, 1, 37, 53), (1, 4, 37, 53), (2, 4, 24, 40)])
def test_split_head_conv_error_budget(layout, b, t, h, w):
    x, wt, bias = _case(b=b, t=t, h=h, w=w, seed=3, layout=layout)
    ref = _ref(x, wt, bias)
    budget = 2 * _torch_bf16_err(x, wt, bias, ref)
    out = hk.split_head_conv(x, wt, bias)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert _rel(out, ref) <= budget, f"split {_rel(out, ref):.3e} > 2x torch bf16 {budget / 2:.3e}"


def test_f32_g_error_budget():
    # The f32-g variant of the stencil (g from an fp32 conv): error is the output rounding alone.
    x, wt, bias = _case(seed=4)
    ref = _ref(x, wt, bias)
    g = hk.conv_n128_ref(x.float(), pack_weight(wt))
    out = hs.head_stencil(g, bias.float(), 4, 0, 37, 37, 0)
    assert _rel(out.bfloat16(), ref) <= 2 * _torch_bf16_err(x, wt, bias, ref)


@pytest.mark.parametrize("layout", ["ncdhw", "cl3d"])
@pytest.mark.parametrize("band_rows", [1, 5, 16])
def test_banded_equals_full(layout, band_rows):
    x, wt, bias = _case(t=4, seed=5, layout=layout)
    full = hk.split_head_conv(x, wt, bias)
    band = hk.split_head_conv(x, wt, bias, band_rows=band_rows)
    # cuDNN / cuBLAS may pick another algorithm for the band shapes: g can differ in a last bf16 bit, no more
    # (split-K with bf16 partial sums gave 3e-3 here before _fp32_reduction).
    assert _rel(band, full.float()) < 2e-3
    ref = _ref(x, wt, bias)
    assert _rel(band, ref) <= 2 * _torch_bf16_err(x, wt, bias, ref)


def test_wrong_shapes_raise_on_cuda():
    x, wt, bias = _case(t=4, h=9, w=7)
    g = hk.conv_n128(x, pack_weight(wt))
    b32 = bias.float()
    with pytest.raises(ValueError, match="T=3"):
        hs.head_stencil(g, b32, 3, 0, 9, 9, 0)
    with pytest.raises(ValueError, match="rows_g=9"):
        hs.head_stencil(g[:, :, :8], b32, 4, 0, 9, 9, 0)
    with pytest.raises(ValueError, match="rows_g=5"):
        hs.head_stencil(g, b32, 4, 2, 3, 9, 1)


def test_opcheck():
    x, wt, bias = _case(t=2, h=11, w=13, seed=6)
    wp = pack_weight(wt)
    torch.library.opcheck(hk.conv_n128, (x, wp))
    torch.library.opcheck(hk.conv_n128, (x.contiguous(memory_format=CL3D), wp.contiguous(memory_format=CL3D)))
    g = hk.conv_n128(x, wp)
    torch.library.opcheck(hs.head_stencil, (g, bias.float(), 2, 0, 11, 11, 0))
    torch.library.opcheck(hs.head_stencil, (g[:, :, 3:9], bias.float(), 2, 4, 4, 11, 1))
    torch.library.opcheck(hs.head_stencil, (g.contiguous(), bias.float(), 2, 0, 11, 11, 0))
    torch.library.opcheck(hs.head_stencil, (g[:, :, 3:9], bias.float(), 2, 4, 4, 11, 1, 2))


@pytest.mark.parametrize("band_rows", [None, 8])
def test_torch_compile_fullgraph(band_rows):
    x, wt, bias = _case(t=4, seed=7, layout="cl3d")
    f = torch.compile(hk.split_head_conv, fullgraph=True)
    got = f(x, wt, bias, band_rows=band_rows)
    ref = _ref(x, wt, bias)
    assert _rel(got, ref) <= 2 * _torch_bf16_err(x, wt, bias, ref)
    x2 = _case(t=4, seed=8, layout="cl3d")[0]
    torch.testing.assert_close(f(x2, wt, bias, band_rows=band_rows), hk.split_head_conv(x2, wt, bias, band_rows))


@pytest.mark.parametrize("layout", ["ncdhw", "cl3d"])
def test_cuda_graph_replay_with_new_inputs(layout):
    x, wt, bias = _case(t=4, seed=9, layout=layout)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: kernel compile, weight cache, cuDNN plans
        for _ in range(2):
            hk.split_head_conv(static_x, wt, bias)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = hk.split_head_conv(static_x, wt, bias)
    for seed in (10, 11):
        new_x = _case(t=4, seed=seed, layout=layout)[0]
        static_x.copy_(new_x)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, hk.split_head_conv(new_x, wt, bias))
