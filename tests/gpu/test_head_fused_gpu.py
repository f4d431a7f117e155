"""GPU checks of the head rows (kinds head_full and head, kernels/rows.py), each through its own run, and of the
fused head op (taesd_fast::fused_head, kernels/head_full_common.py) with each fused row's g kernel (triton_fused in its
"roll" and "per_t" variants, gluon_fused, cuda_fused): against OutputHead, chunked against one-shot, poisoned
outputs, CUDA-graph capture, opcheck.

Tolerance: ||out - ref|| / ||ref|| against an fp32 OutputHead (TF32 off) at most 2x the error of OutputHead's own
bf16 path (backend "torch"). The returned cache may differ from OutputHead's where the fp32 norm lands on a
bf16 rounding boundary (the kernel sums the squares in another order): that last-bit flip of the normed value
moves SiLU's output by at most 2 of its own bf16 steps; allowed in at most 0.1% of the elements.
"""

import pytest
import torch

from conftest import random_output_head, video_from_channels
from taesd_fast import OutputHead, backend
from taesd_fast.dispatch import table
from taesd_fast.kernels import head_full_common as hf
from taesd_fast.kernels import rows as kernel_rows
from taesd_fast.kernels import triton_fused
from taesd_fast.kernels.triton_import import triton_unavailable_reason


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return "bf16 tl.dot needs sm_80+"
    return triton_unavailable_reason()


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=f"fused head unavailable: {_unavailable()}")

EPS = 1e-12
# (row, its g kernel's config): a few configs of the Triton kernel (the bench sweeps more; the first is the row's
# default), then the Hopper rows, which have none.
CONFIGS = [
    ("triton_fused", dict(triton_fused.DEFAULT_CONFIG)),
    ("triton_fused", {"variant": "roll", "block_m": 32, "block_k": 32, "num_warps": 4, "num_stages": 3}),
    ("triton_fused", {"variant": "per_t", "block_m": 64, "block_k": 64, "num_warps": 8, "num_stages": 3}),
    ("triton_fused", {"variant": "per_t", "block_m": 128, "block_k": 32, "num_warps": 8, "num_stages": 2}),
    ("gluon_fused", {}),  # the Gluon kernel (sm_90; H*W a multiple of 8)
    ("cuda_fused", {}),  # the CUDA C++ kernel (sm_90; the same shapes)
]
TRITON = "triton_fused"
WGMMA, CUDA = len(CONFIGS) - 2, len(CONFIGS) - 1
HOPPER = [WGMMA, CUDA]
FUSED_ROWS = list(hf.FUSED_ROWS)


def _fused(cfg: int, features, cache, gamma, weight, bias, eps, scale, patch=0):
    """fused_head_with with CONFIGS[cfg]: its row, and that row's g-kernel config."""
    row, config = CONFIGS[cfg]
    return hf.fused_head_with(row, features, cache, gamma, weight, bias, eps, scale, patch, **config)


def _needs_row(row: str):
    if row != TRITON:
        _needs_sm90()


@pytest.fixture(autouse=True)
def _poison(monkeypatch, no_tf32):
    monkeypatch.setattr(hf, "POISON", True)  # NaN-fill g and the new cache: unwritten elements show



def _head(c: int = 256, seed: int = 0) -> OutputHead:
    return random_output_head(c, seed).cuda()


def _inputs(b, c, t, h, w, seed, with_cache=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    features = (3 * torch.randn(b, c, t, h, w, device="cuda", generator=gen)).bfloat16()
    cache = None
    if with_cache:
        cache = torch.nn.functional.silu(torch.randn(b, c, 2, h, w, device="cuda", generator=gen)).bfloat16()
    return features, cache


def _params(head: OutputHead):
    """(gamma, weight, bias) as plain bf16 tensors (detached: the op has no backward)."""
    return tuple(p.detach().bfloat16() for p in (head.norm_out.gamma, head.conv_out.weight, head.conv_out.bias))


def _rel(out, ref) -> float:
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _references(head: OutputHead, features, cache):
    """(fp32 OutputHead output, OutputHead bf16 output, its returned cache), both through the torch backend."""
    head16 = _head(head.in_channels).bfloat16()
    head16.load_state_dict({k: v.bfloat16() for k, v in head.state_dict().items()})
    with torch.no_grad(), backend("torch"):
        ref, _ = head(features.float(), None if cache is None else cache.float())
        out16, cache16 = head16(features, cache)
    return ref, out16, cache16


def _assert_cache_close(got, want):
    assert torch.isfinite(got).all(), "new cache has NaN: an element was left unwritten"
    diff = (got.float() - want.float()).abs()
    step = want.float().abs().clamp_min(2.0**-126) * 2.0**-7
    frac = (diff > 0).float().mean().item()
    assert frac <= 1e-3 and (diff / step).max().item() <= 2.0, f"{frac:.2e} of the cache differs, up to {diff.max()}"


# Odd sizes (not multiples of any block), T=1 (the new cache keeps an old frame), a 1x1 image. Every distinct
# shape/config is one Triton compile (seconds), so the other configs run on two shapes only.
SHAPES = [(1, 1, 37, 53), (1, 4, 37, 53), (2, 3, 17, 29), (1, 5, 9, 70), (2, 2, 1, 1)]
CASES = ([(0, *shape) for shape in SHAPES]
         + [(cfg, *shape) for cfg in range(1, WGMMA) for shape in [(1, 4, 37, 53), (2, 1, 17, 29)]])
# The Hopper kernels: whole and partial 64-pixel tiles, T = 1 (first chunk), several images, and more tiles than SMs
# (programs walk several tiles, the TMA ring runs across tile boundaries).
WGMMA_SHAPES = [(1, 4, 24, 40), (2, 3, 12, 20), (1, 1, 20, 36), (3, 5, 8, 8), (1, 4, 88, 160), (2, 2, 64, 136)]


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper head kernels need sm_90")


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("cfg,b,t,h,w", CASES)
def test_matches_output_head(cfg, b, t, h, w, with_cache):
    head = _head(seed=t)
    features, cache = _inputs(b, 256, t, h, w, seed=10 * t + h, with_cache=with_cache)
    ref, out16, cache16 = _references(head, features, cache)
    out, new_cache = _fused(cfg, features, cache, *_params(head), EPS, 256**0.5)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert _rel(out, ref) <= 2 * _rel(out16, ref), f"fused {_rel(out, ref):.3e} vs torch bf16 {_rel(out16, ref):.3e}"
    _assert_cache_close(new_cache, cache16)


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("b,t,h,w", WGMMA_SHAPES)
@pytest.mark.parametrize("cfg", HOPPER)
def test_hopper_kernels_match_output_head(cfg, b, t, h, w, with_cache):
    _needs_sm90()
    test_matches_output_head(cfg, b, t, h, w, with_cache)


@pytest.mark.parametrize("c,t", [(64, 3), (128, 1), (128, 2)])
def test_cuda_kernel_other_channel_counts(c, t):
    """C = 64, 128 (fewer chunks per frame, a deeper ring) against an fp32 OutputHead, with and without cache."""
    _needs_sm90()
    head = _head(c, seed=c)
    for with_cache in (False, True):
        features, cache = _inputs(2, c, t, 12, 20, seed=c + t, with_cache=with_cache)
        ref, out16, cache16 = _references(head, features, cache)
        out, new_cache = _fused(CUDA, features, cache, *_params(head), EPS, c**0.5)
        assert _rel(out, ref) <= 2 * _rel(out16, ref), f"{_rel(out, ref):.3e} vs torch bf16 {_rel(out16, ref):.3e}"
        _assert_cache_close(new_cache, cache16)


@pytest.mark.parametrize("t", [17, 20])
def test_cuda_kernel_takes_any_frame_count(t):
    """T is a kernel argument (the Gluon kernel unrolls frames and stops at 16): more frames than the 3-frame loop
    body's multiples, against an fp32 OutputHead, with and without cache."""
    _needs_sm90()
    from taesd_fast.kernels import gluon_fused

    head = _head(seed=t)
    for with_cache in (False, True):
        features, cache = _inputs(1, 256, t, 8, 24, seed=t, with_cache=with_cache)
        assert "T=" in gluon_fused.unsupported_reason(features, cache)
        ref, out16, cache16 = _references(head, features, cache)
        out, new_cache = _fused(CUDA, features, cache, *_params(head), EPS, 256**0.5)
        assert _rel(out, ref) <= 2 * _rel(out16, ref), f"{_rel(out, ref):.3e} vs torch bf16 {_rel(out16, ref):.3e}"
        _assert_cache_close(new_cache, cache16)


def test_tma_descriptors_are_reused_only_for_the_same_memory_and_view():
    """tma.tensor_map keeps recent descriptors: the same address and view give the kept one, with the bytes a
    fresh encoding gives; another address or box gives another; the number kept is bounded."""
    _needs_sm90()
    from taesd_fast.kernels import tma

    x = torch.randn(2, 64, 3, 8, 16, device="cuda").bfloat16()
    args = ([128, 3, 64, 2], [64 * 128, 128, 64 * 3 * 128], [64, 1, 64, 1])
    first = tma.tensor_map(x, *args)
    assert tma.tensor_map(x, *args) is first
    assert bytes(first) == bytes(tma._encode_tensor_map(x, *args, True))
    assert tma.tensor_map(x[1:], [128, 3, 64, 1], args[1], args[2]) is not first
    assert bytes(tma.tensor_map(x.clone(), *args)) != bytes(first)  # another address
    assert bytes(tma.tensor_map(x, *args[:2], [32, 1, 64, 1])) != bytes(first)
    for i in range(tma._TENSOR_MAPS_KEPT):  # as many other views: the first is pushed out
        tma.tensor_map(x, [128 - i, 3, 64, 2], args[1], [8, 1, 64, 1])
    assert len(tma._tensor_maps) == tma._TENSOR_MAPS_KEPT
    again = tma.tensor_map(x, *args)
    assert again is not first and bytes(again) == bytes(first)


@pytest.mark.parametrize("cfg", HOPPER)
def test_hopper_kernels_refuse_what_they_cannot_run(cfg):
    _needs_sm90()
    head = _head(seed=11)
    features, cache = _inputs(1, 256, 2, 9, 7, seed=11)  # H*W = 63: TMA needs rows of 16 bytes
    name = CONFIGS[cfg][0]
    with pytest.raises(ValueError, match=f"row '{name}' cannot run this call: H\\*W=63 is not a multiple of 8"):
        _fused(cfg, features, cache, *_params(head), EPS, 256**0.5)
    out, _ = _fused(0, features, cache, *_params(head), EPS, 256**0.5)  # the Triton row takes it
    assert torch.isfinite(out).all()


def test_a_cuda_kernel_failure_is_remembered(monkeypatch):
    """The CUDA row's kernel agrees with the Gluon row's (to the fp32 summation order). If it cannot compile or launch,
    the call raises with one warning, and from then on its rule names the failure (the dispatcher then takes
    another row); nothing inside the fused head falls back to another kernel."""
    _needs_sm90()
    from taesd_fast.kernels import cuda_fused

    head = _head(seed=14)
    features, cache = _inputs(1, 256, 4, 24, 40, seed=14)
    args = (features, cache, *_params(head), EPS, 256**0.5)
    cuda_out, cuda_cache = _fused(CUDA, *args)
    gluon_out, gluon_cache = _fused(WGMMA, *args)

    def refuse(*a):
        raise RuntimeError("NVRTC could not compile head_g_sm90.cu for sm_90a (test)")

    monkeypatch.setattr(cuda_fused, "_failure", [])
    monkeypatch.setattr(cuda_fused, "launch", refuse)
    with pytest.warns(RuntimeWarning, match="the CUDA head kernel is unavailable .*other kernels run instead"):
        with pytest.raises(RuntimeError, match="NVRTC could not compile"):
            _fused(CUDA, *args)
    assert "NVRTC could not compile" in cuda_fused.unsupported_reason(features, cache)
    with pytest.raises(ValueError, match="row 'cuda_fused' cannot run this call: RuntimeError: NVRTC"):
        _fused(CUDA, *args)
    ref, out16, _ = _references(head, features, cache)
    assert _rel(cuda_out, ref) <= 2 * _rel(out16, ref) and _rel(gluon_out, ref) <= 2 * _rel(out16, ref)
    _assert_cache_close(cuda_cache, gluon_cache)


@pytest.mark.parametrize("cfg,h,w", [(0, 37, 53), (2, 37, 53), (WGMMA, 24, 40), (CUDA, 24, 40)])
def test_chunked_equals_one_shot(cfg, h, w):
    if cfg in HOPPER:
        _needs_sm90()
    head = _head(seed=3)
    features, _ = _inputs(1, 256, 4, h, w, seed=3, with_cache=False)
    args = (*_params(head), EPS, 256**0.5)
    one, one_cache = _fused(cfg, features, None, *args)
    a, cache = _fused(cfg, features[:, :, :2], None, *args)  # a strided slice: read in place
    b, cache = _fused(cfg, features[:, :, 2:], cache, *args)
    chunked = torch.cat([a, b], dim=2)
    assert torch.isfinite(chunked).all()
    # Same operands in the same order; allow a last-bit difference anyway (one bf16 step of values <= 1).
    assert (chunked.float() - one.float()).abs().max().item() <= 2**-7
    assert torch.equal(cache, one_cache)
    ref, out16, _ = _references(head, features, None)
    assert _rel(chunked, ref) <= 2 * _rel(out16, ref)


@pytest.mark.parametrize("row", FUSED_ROWS)
def test_chunk_of_one_then_four_like_the_decoder(row):
    """1 frame, then 4, then 4 (the Wan decode pattern), against OutputHead run the same way."""
    _needs_row(row)
    head = _head(seed=4)
    head16 = _head(seed=4).bfloat16()
    features, _ = _inputs(1, 256, 9, 20, 36, seed=4, with_cache=False)
    cache, cache16, outs, outs16 = None, None, [], []
    for lo, hi in ((0, 1), (1, 5), (5, 9)):
        out, cache = hf.fused_head(row, features[:, :, lo:hi], cache, *_params(head), EPS, 256**0.5)
        with torch.no_grad(), backend("torch"):
            o16, cache16 = head16(features[:, :, lo:hi], cache16)
        outs.append(out)
        outs16.append(o16)
        _assert_cache_close(cache, cache16)
    with torch.no_grad(), backend("torch"):
        ref, _ = head(features.float())
    assert _rel(torch.cat(outs, 2), ref) <= 2 * _rel(torch.cat(outs16, 2), ref)


def test_channels_last_input_and_view_cache():
    """A channels_last_3d input is copied to NCDHW first; a cache that is a view (OutputHead returns
    window[:, :, -2:]) is read through its strides."""
    head = _head(seed=5)
    features, _ = _inputs(1, 256, 3, 11, 13, seed=5, with_cache=False)
    window = torch.nn.functional.silu(torch.randn(1, 256, 5, 11, 13, device="cuda")).bfloat16()
    cache_view = window[:, :, -2:]
    want = hf.fused_head(TRITON, features, cache_view.contiguous(), *_params(head), EPS, 256**0.5)
    got = hf.fused_head(TRITON, features.contiguous(memory_format=torch.channels_last_3d), cache_view, *_params(head),
                        EPS, 256**0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("row", FUSED_ROWS)
def test_row_run_is_the_op(row):
    """A fused row's run (dispatch.head_full's signature, eager: the op's body without the op layer) gives the op's
    results for that row."""
    import importlib

    _needs_row(row)
    head = _head(seed=6)
    features, cache = _inputs(1, 256, 2, 8, 12, seed=6)
    out, new_cache = importlib.import_module(f"taesd_fast.kernels.{row}").run(features, cache, *_params(head), EPS)
    want = hf.fused_head(row, features, cache, *_params(head), EPS, 256**0.5)
    assert torch.equal(out, want[0]) and torch.equal(new_cache, want[1])


@pytest.mark.parametrize("cfg", [0, CUDA])
@pytest.mark.parametrize("with_cache", [False, True])
def test_patch_writes_the_video(cfg, with_cache):
    # The stencil writes the unpatchified video itself: equal to the channel-by-channel unpatchify of the plain output.
    if cfg == CUDA:
        _needs_sm90()
    head = _head(seed=14)
    features, cache = _inputs(2, 256, 3, 24, 40, seed=14, with_cache=with_cache)
    out, new_cache = _fused(cfg, features, cache, *_params(head), EPS, 256**0.5)
    video, video_cache = _fused(cfg, features, cache, *_params(head), EPS, 256**0.5, patch=2)
    assert video.is_contiguous() and torch.equal(video, video_from_channels(out, 2))
    assert torch.equal(video_cache, new_cache)


def test_refuses_fp32_and_bad_shapes():
    head = _head(seed=7)
    features, cache = _inputs(1, 256, 2, 8, 12, seed=7)
    with pytest.raises(ValueError, match="needs torch.bfloat16 features, got torch.float32"):
        hf.fused_head(TRITON, features.float(), cache.float(), *(p.float() for p in _params(head)), EPS, 16.0)
    with pytest.raises(ValueError, match=r"cache must be the \[B, C, 2, H, W\]"):
        hf.fused_head(TRITON, features, cache[:, :, :1], *_params(head), EPS, 16.0)
    with pytest.raises(ValueError, match="is on cpu"):
        hf.fused_head(TRITON, features, cache, *_params(head)[:2], _params(head)[2].cpu(), EPS, 16.0)


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("row", FUSED_ROWS)
def test_cuda_graph_capture_and_replay(row, with_cache):
    _needs_row(row)
    head = _head(seed=8)
    params = _params(head)
    features, cache = _inputs(1, 256, 4, 24, 40, seed=8, with_cache=with_cache)
    static_f = features.clone()
    static_c = None if cache is None else cache.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: Triton compile, stencil module load, weight packing
        for _ in range(2):
            hf.fused_head(row, static_f, static_c, *params, EPS, 256**0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_cache = hf.fused_head(row, static_f, static_c, *params, EPS, 256**0.5)
    for seed in (9, 10):
        new_f, new_c = _inputs(1, 256, 4, 24, 40, seed=seed, with_cache=with_cache)
        static_f.copy_(new_f)
        if static_c is not None:
            static_c.copy_(new_c)
        static_out.fill_(float("nan"))
        static_cache.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_cache = hf.fused_head(row, new_f, new_c, *params, EPS, 256**0.5)
        assert torch.equal(static_out, want_out) and torch.equal(static_cache, want_cache)


HEAD_FULL_ROWS = [r.name for r in kernel_rows.KERNEL_ROWS if r.kind == "head_full"]


@pytest.mark.parametrize("patch", [0, 2])  # the video-writing stencil is a kernel of its own
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("name", HEAD_FULL_ROWS)
def test_each_head_full_row(name, with_cache, patch):
    """Each head_full row through its own run (the dispatcher's signature): accepted on sm_90, within 2x OutputHead's
    own bf16 error against its fp32 output (poisoned g and cache), the new cache OutputHead's, and ready for graph
    capture after one run. 24x40: whole 64-pixel tiles for the Hopper g kernels."""
    from taesd_fast import _backend, dispatch

    if _backend.kernels_unavailable_reason() is not None:
        pytest.skip(f"the stencil kernel is unavailable: {_backend.kernels_unavailable_reason()}")
    row = table.row("head_full", name)
    head = _head(seed=21)
    features, cache = _inputs(1, 256, 3, 24, 40, seed=21, with_cache=with_cache)
    spec = dispatch.Spec("head_full", "cuda:0", tuple(features.shape), (12, 256, 3, 3, 3), torch.bfloat16, 1, True,
                         with_cache, False, "nchw", patch=patch)
    why = row.supports(spec)
    if why is not None and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{name} does not run on this GPU: {why}")
    assert why is None, f"{name} must accept the call on sm_90: {why}"
    gamma, weight, bias = _params(head)
    out, new_cache = row.run(features, cache, gamma, weight, bias, EPS, patch)
    torch.cuda.synchronize()
    ref, out16, cache16 = _references(head, features, cache)
    if patch:
        ref, out16 = video_from_channels(ref, patch), video_from_channels(out16, patch)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 2 * _rel(out16, ref), f"{name} {_rel(out, ref):.3e} vs torch bf16 {_rel(out16, ref):.3e}"
    _assert_cache_close(new_cache, cache16)
    assert row.ready(spec), "launched once, the row must report itself ready for graph capture"


def test_split_head_row():
    """The head row (kind head: the conv on an activated window) through its own run, against an fp32 conv3d."""
    from taesd_fast import _backend

    if _backend.kernels_unavailable_reason() is not None:
        pytest.skip(f"the stencil kernel is unavailable: {_backend.kernels_unavailable_reason()}")
    row = table.row("head", "split_bf16")
    head = _head(seed=22)
    _, weight, bias = _params(head)
    gen = torch.Generator(device="cuda").manual_seed(22)
    window = torch.nn.functional.silu(torch.randn(1, 256, 5, 17, 29, device="cuda", generator=gen)).bfloat16()
    out = row.run(window, weight, bias)
    ref = torch.nn.functional.conv3d(window.float(), weight.float(), bias.float(), padding=(0, 1, 1)).clamp(-1, 1)
    out16 = torch.nn.functional.conv3d(window, weight, bias, padding=(0, 1, 1)).clamp(-1, 1)
    assert _rel(out, ref) <= 2 * _rel(out16, ref)


@pytest.mark.parametrize("row,h,w", [(TRITON, 9, 11), ("gluon_fused", 8, 16), ("cuda_fused", 8, 16)])
@pytest.mark.parametrize("with_cache", [False, True])
def test_opcheck(with_cache, row, h, w):
    _needs_row(row)
    head = _head(seed=12)
    features, cache = _inputs(1, 256, 2, h, w, seed=12, with_cache=with_cache)
    torch.library.opcheck(hf.fused_head, (row, features, cache, *_params(head), EPS, 256**0.5))
    torch.library.opcheck(hf.fused_head, (row, features, cache, *_params(head), EPS, 256**0.5, 2))


@pytest.mark.parametrize("row", FUSED_ROWS)
def test_torch_compile_fullgraph(row):
    _needs_row(row)
    head = _head(seed=13)
    params = _params(head)
    features, cache = _inputs(1, 256, 2, 12, 20, seed=13)

    @torch.compile(fullgraph=True)
    def f(x, c):
        out, new_cache = hf.fused_head(row, x, c, *params, EPS, 256**0.5)
        return out.float() * 2, new_cache

    got, got_cache = f(features, cache)
    want, want_cache = hf.fused_head(row, features, cache, *params, EPS, 256**0.5)
    assert torch.equal(got, want.float() * 2) and torch.equal(got_cache, want_cache)


# The Wan chunk (26-27 tiles per program: the rings wrap), and shapes with at most one tile per program, where the
# race this guards against (a raw slot reloaded before a warp had read it) showed in 6-13 runs of 20 (at the Wan
# chunk in 0-1).
REPEAT_SHAPES = [(4, 352, 640, True), (1, 352, 640, False), (3, 64, 72, True), (4, 64, 72, False)]


@pytest.mark.parametrize("t,h,w,with_cache", REPEAT_SHAPES)
@pytest.mark.parametrize("cfg", HOPPER)
def test_hopper_repeat_runs_are_bitwise_equal(cfg, t, h, w, with_cache):
    """The Hopper kernels hand slots over through mbarriers only (compute-sanitizer's racecheck does not follow the
    TMA load's barrier completion between them); their sums have a fixed order, so any lost
    handover would show as a run that differs."""
    _needs_sm90()
    head = _head(seed=12)
    features, cache = _inputs(1, 256, t, h, w, seed=12, with_cache=with_cache)
    args = (features, cache, *_params(head), EPS, 256**0.5)
    first_out, first_cache = _fused(cfg, *args)
    differing = 0
    for _ in range(20):
        out, new_cache = _fused(cfg, *args)
        differing += not (torch.equal(out, first_out) and torch.equal(new_cache, first_cache))
    assert differing == 0, f"{differing} of 20 runs differ from the first"


@pytest.mark.parametrize("t,h,w,with_cache", [(3, 64, 72, True), (1, 40, 48, False)])
def test_gluon_kernel_1000_fresh_runs_are_bitwise_repeatable_and_right(t, h, w, with_cache):
    """compute-sanitizer's racecheck reports hazards in the Gluon g kernel between the activation partition's
    store of a normalised chunk and the MMA partition's load of it. What orders them: every activation warp
    stores, fences and meets the partition's barrier (bar.sync, which orders the warps' shared-memory writes),
    then one thread arrives on the chunk's `act` mbarrier (a release at CTA scope); the MMA partition waits on
    that mbarrier (an acquire) before it loads. racecheck does not model ordering through mbarriers, so it reports
    a hazard there. The guard: 1,000 runs, each on fresh data, run twice and bitwise equal (the sums have a fixed
    order), every 50th also within the error bound against fp32, with NaN-poisoned outputs."""
    _needs_sm90()
    head = _head(seed=21)
    params = _params(head)
    bound = None
    for i in range(1000):
        features, cache = _inputs(1, 256, t, h, w, seed=1000 + i, with_cache=with_cache)
        args = (features, cache, *params, EPS, 256**0.5)
        out, new_cache = _fused(WGMMA, *args)
        again, again_cache = _fused(WGMMA, *args)
        assert torch.equal(out, again) and torch.equal(new_cache, again_cache), f"run {i} differs on the same data"
        if i % 50 == 0:
            ref, out16, _ = _references(head, features, cache)
            bound = 2 * _rel(out16, ref)
            assert _rel(out, ref) <= bound, f"run {i}: {_rel(out, ref):.3g} vs bound {bound:.3g}"
