"""The Triton tensor-core rows on the GPU: "triton_conv" (the pointer kernel, kernels/triton_conv.py, also the default
variant of the taesd_fast::conv3x3_tc op) and "triton_conv_tma" (kernels/triton_conv_tma.py), and the op itself.

Every check compares against a float64 reference with the bound set by cuDNN's own f16 error on the same inputs
(the f16 ops the model runs today: Clamp, nn.Upsample, conv, + skip, ReLU): rel err <= 2x that. Outputs are
NaN-poisoned before every launch (conv_contract.POISON_OUTPUT), inputs are fresh random normals (never zeros).

The upsample fold adds one f16 rounding of the summed weights: its error is ~1.4x cuDNN's in the median, but on
outputs of only a few dozen elements the ratio is noisy (a simulation over 300 seeds: 1x1 -> 2x2 outputs with 3
channels exceed 2x 15% of the time), so the upsample cases here have outputs of several hundred elements or more.

Layouts: the kernel reads dense NHWC. NCHW or strided x / residual are accepted and copied to channels_last first
(tested: same bits as the channels_last call); the output is always channels_last.

Each distinct (C_in, C_out, stride, upsample, epilogue flags, config) is one Triton compile (~1 s); sizes are not
specialised. This file compiles ~60 kernels on a cold Triton cache.
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_worst_element_within

from taesd_fast.kernels import conv_contract, conv_launch, triton_conv_tma
from taesd_fast.kernels import triton_conv as tc

_REASON = "CUDA is not available" if not torch.cuda.is_available() else tc.triton_unavailable_reason("cuda")
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"Triton conv kernel unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32"),  # fp32 references must not run in TF32
]

OP = torch.ops.taesd_fast.conv3x3_tc
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _make(B, cin, cout, H, W, stride, upsample, bias, residual, gen):
    dev = "cuda"
    x = torch.randn(B, cin, H, W, generator=gen, device=dev).half().contiguous(memory_format=CL)
    w = (torch.randn(cout, cin, 3, 3, generator=gen, device=dev) / (3 * cin**0.5)).half()
    b = (torch.randn(cout, generator=gen, device=dev) * 0.5).half() if bias else None
    oshape = tc.output_shape(x.shape, w.shape, stride, upsample)
    r = torch.randn(oshape, generator=gen, device=dev).half().contiguous(memory_format=CL) if residual else None
    return x, w, b, r


def _reference(*args):
    return conv_contract.conv3x3_math(*args, dtype=torch.float64)


def _torch_f16(*args):
    return conv_contract.conv3x3_math(*args)  # cuDNN in f16, op by op: what the model runs without the kernel


def _check(B, cin, cout, H, W, stride=1, upsample=1, bias=True, residual=True, relu=True, pre_clamp=False, seed=0,
           config=None, row=None):
    """One call on fresh inputs: through the op (default variant: the pointer kernel), or with an explicit config
    (a TCConfig: the pointer kernel's launcher; a TMAConfig: the TMA kernel's), or a row module's run."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w, b, r = _make(B, cin, cout, H, W, stride, upsample, bias, residual, gen)
    args = (x, w, b, r, stride, relu, upsample, pre_clamp)
    before = set(conv_launch._launched)
    if row is not None:
        y = row.run(x, w, b, stride, r, relu, upsample, pre_clamp)
    elif isinstance(config, triton_conv_tma.TMAConfig):
        y = triton_conv_tma.conv3x3_tma_launch(*args, config=config)
    else:
        y = OP(*args) if config is None else tc.conv3x3_tc_launch(*args, config=config)
    want = "triton_conv_tma" if row is triton_conv_tma or isinstance(config, triton_conv_tma.TMAConfig) else "triton_conv"
    assert {k[0] for k in set(conv_launch._launched) - before} <= {want}, "another kernel ran"
    ref = _reference(*args)
    assert y.shape == ref.shape and y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
    assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
    low = _torch_f16(*args)
    err, torch_err = _rel(y, ref), _rel(low, ref)
    assert err <= 2 * torch_err + 1e-7, f"rel err {err:.3g} > 2 x cuDNN f16 error {torch_err:.3g}"
    assert_worst_element_within(y, low, ref)
    return err, torch_err


# Channel counts of TAESD (3, 4, 16, 32, 64) and the f32 variant's wider stages; odd sizes below and above the tiles.
EDGE = [
    # B, cin, cout, H, W, stride, upsample
    (1, 64, 64, 33, 47, 1, 1),
    (2, 3, 64, 17, 29, 1, 1),
    (2, 64, 3, 31, 15, 1, 1),
    (3, 4, 64, 5, 7, 1, 1),
    (1, 64, 64, 1, 1, 1, 1),
    (4, 64, 16, 16, 16, 2, 1),
    (2, 32, 64, 19, 21, 2, 1),
    (1, 3, 32, 35, 9, 2, 1),
    (2, 64, 64, 23, 37, 1, 2),
    (1, 16, 64, 9, 70, 1, 2),
    (2, 64, 32, 1, 3, 1, 2),
    (1, 256, 128, 12, 10, 1, 2),
]


@pytest.mark.parametrize("case", EDGE, ids=lambda c: "x".join(map(str, c)))
def test_edge_shapes(case):
    B, cin, cout, H, W, stride, up = case
    seed = zlib.crc32(repr(case).encode())
    flags = random.Random(seed).choice([(True, True, True), (True, False, True), (False, True, False), (True, False, False)])
    _check(B, cin, cout, H, W, stride, up, *flags, pre_clamp=cin in (4, 16), seed=seed)


@pytest.mark.parametrize("bias,residual,relu,pre_clamp", list(itertools.product([False, True], repeat=4)))
def test_epilogue_combinations(bias, residual, relu, pre_clamp):
    _check(2, 64, 64, 21, 26, 1, 1, bias, residual, relu, pre_clamp, seed=int(bias) + 2 * residual + 4 * relu + 8 * pre_clamp)


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
def test_upsample_epilogues(bias, residual, relu):
    _check(2, 64, 64, 13, 18, 1, 2, bias, residual, relu, seed=100 + int(bias) + 2 * residual + 4 * relu)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed):
    rng = random.Random(3000 + seed)
    cin, cout = rng.choice([3, 4, 16, 32, 64, 128]), rng.choice([3, 4, 16, 32, 64, 256])
    up = rng.choice([1, 2])
    stride = 1 if up == 2 else rng.choice([1, 2])
    side = 20 if cin * cout > 64 * 64 else 60  # the float64 reference conv is slow for the wide layers
    B, H, W = rng.randint(1, 4), rng.randint(1, side), rng.randint(1, side)
    flags = (rng.random() < 0.7, rng.random() < 0.5, rng.random() < 0.7, rng.random() < 0.3)
    _check(B, cin, cout, H, W, stride, up, *flags, seed=seed)


TMA = triton_conv_tma.TMAConfig


@pytest.mark.parametrize("cfg", [tc.TCConfig(64, 4, 2), tc.TCConfig(256, 8, 3), tc.TCConfig(128, 8, 4),
                                 tc.TCConfig(128, 4, 3, block_k=32), tc.TCConfig(128, 4, 3, cache_a=True),
                                 tc.TCConfig(256, 8, 2, cache_a=True), TMA(128, 4, 3, 16), TMA(64, 4, 4, 8),
                                 TMA(256, 8, 3, 32), TMA(128, 4, 3, 16, persistent=2),
                                 TMA(128, 4, 3, 128, weight_tma=True), TMA(128, 4, 3, 16, weight_tma=True)], ids=str)
@pytest.mark.parametrize("upsample", [1, 2])
def test_explicit_configs(cfg, upsample):
    """What the benchmark sweeps must be right too (block_k=32 makes two channel chunks per tap)."""
    _check(2, 64, 64, 37, 45, 1, upsample, True, True, True, seed=7, config=cfg)


TMA_CASES = [  # B, cin, cout, H, W, upsample, bias, residual, relu: the TMA row's shapes (stride 1, C_in % 16 == 0)
    (2, 64, 64, 33, 47, 1, True, True, True), (1, 64, 3, 31, 15, 1, True, False, False),
    (2, 32, 64, 19, 21, 1, False, True, True), (2, 64, 64, 23, 37, 2, True, False, True),
    (1, 128, 160, 12, 10, 1, True, True, False), (1, 256, 128, 12, 10, 2, False, False, False),
    (1, 64, 64, 1, 1, 1, True, True, True),
    # one-row tiles (row_config): 128-pixel rows at 64 channels; 64- and 128-pixel rows with 128-wide channel blocks
    (2, 64, 64, 9, 256, 1, True, True, True), (1, 64, 64, 5, 128, 2, False, False, True),
    (1, 256, 128, 10, 64, 2, False, False, False), (1, 128, 128, 20, 128, 1, True, True, True)]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: "x".join(map(str, c[:6])))
def test_tma_row(case):
    """The TMA row through its own run (its default config), tiles straddling every edge."""
    B, cin, cout, H, W, up, bias, res, relu = case
    if triton_conv_tma.spec_unsupported_reason(_spec_of(B, cin, cout, H, W, up, bias, res, relu)) is not None:
        pytest.skip("the TMA kernel needs sm_90+")
    _check(B, cin, cout, H, W, 1, up, bias, res, relu, seed=zlib.crc32(repr(case).encode()), row=triton_conv_tma)


# TAEHV's wide convs (frames of one chunk as the batch; fewer frames here, to keep the float64 reference cheap).
# One frame (TAEHV's streaming step): grids short of the SMs, where the TMA row takes 64-wide channel blocks, or
# one-row tiles in 128-wide blocks where the width is a multiple of 64 (row_config); at 64 channels, 128-pixel rows
# where the width is a multiple of 128.
WIDE = [(8, 128, 128, 88, 160), (8, 256, 128, 88, 160), (8, 256, 256, 44, 80), (8, 128, 64, 176, 320),
        (1, 256, 256, 44, 80), (1, 256, 256, 40, 64), (1, 128, 128, 80, 128), (2, 64, 64, 160, 256)]


@pytest.mark.parametrize("row", ["triton_conv_tma", "triton_conv"])
@pytest.mark.parametrize("case", WIDE, ids=lambda c: "x".join(map(str, c)))
def test_wide_channels_every_launch(case, row):
    """30 launches on fresh inputs, each checked element by element: a pipeline that loses a few elements in some
    launches only (three-stage TMA pipelines at 128-wide channel blocks did, with Triton 3.6) fails here."""
    B, cin, cout, H, W = case
    if row == "triton_conv_tma" and triton_conv_tma.spec_unsupported_reason(
            _spec_of(B, cin, cout, H, W, 1, True, False, True)) is not None:
        pytest.skip("the TMA kernel needs sm_90+")
    for seed in range(30):
        _check(B, cin, cout, H, W, 1, 1, True, False, True, seed=seed,
               row=triton_conv_tma if row == "triton_conv_tma" else None)


def _spec_of(B, cin, cout, H, W, up, bias, res, relu):
    from taesd_fast.dispatch import Spec

    return Spec("conv2d", "cuda:0", (B, cin, H, W), (cout, cin, 3, 3), torch.float16, 1, bias, res, relu,
                "channels_last", up, False)


def test_non_channels_last_inputs_are_converted():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, w, b, r = _make(2, 32, 64, 15, 22, 1, 1, True, True, gen)
    y_cl = OP(x, w, b, r, 1, True, 1, False)
    wide = torch.randn(2, 32, 15, 44, generator=gen, device="cuda").half()
    for xi, ri in [(x.contiguous(), r.contiguous()), (x, r.contiguous()), (x.contiguous(), r)]:
        y = OP(xi, w, b, ri, 1, True, 1, False)
        assert y.is_contiguous(memory_format=CL)
        assert torch.equal(y, y_cl)
    strided = wide[..., ::2]  # neither NCHW- nor NHWC-dense
    y = OP(strided, w, b, r, 1, True, 1, False)
    assert torch.equal(y, OP(strided.contiguous(memory_format=CL), w, b, r, 1, True, 1, False))


def test_weight_update_in_place_is_seen():
    gen = torch.Generator(device="cuda").manual_seed(4)
    x, w, b, _ = _make(1, 64, 64, 9, 9, 1, 1, True, False, gen)
    y1 = OP(x, w, b, None, 1, False, 1, False)
    with torch.no_grad():
        w.mul_(-1)
    y2 = OP(x, w, b, None, 1, False, 1, False)
    ref = _reference(x, w, b, None, 1, False, 1, False)
    assert _rel(y2, ref) <= 2 * _rel(_torch_f16(x, w, b, None, 1, False, 1, False), ref) + 1e-7
    assert not torch.equal(y1, y2)


def test_unsupported_raises():
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, w, b, r = _make(1, 16, 16, 8, 8, 1, 1, True, True, gen)
    with pytest.raises(ValueError, match="float16"):
        OP(x.float(), w, b, r, 1, True, 1, False)
    with pytest.raises(ValueError, match="stride"):
        OP(x, w, b, r, 3, True, 1, False)
    with pytest.raises(ValueError, match="upsample=2 needs stride 1"):
        OP(x, w, b, None, 2, True, 2, False)
    with pytest.raises(ValueError, match="is on cpu"):
        OP(x, w.cpu(), b, r, 1, True, 1, False)


def test_opcheck():
    gen = torch.Generator(device="cuda").manual_seed(6)
    x, w, b, r = _make(2, 16, 32, 13, 11, 1, 1, True, True, gen)
    torch.library.opcheck(OP.default, (x, w, b, r, 1, True, 1, False))
    x, w, b, r = _make(2, 16, 32, 7, 5, 1, 2, False, True, gen)
    torch.library.opcheck(OP.default, (x, w, None, r, 1, True, 2, True))
    x, w, b, r = _make(1, 4, 16, 9, 9, 2, 1, True, False, gen)
    torch.library.opcheck(OP.default, (x, w, b, None, 2, False, 1, False))


def _chain(x, w0, w1, w2, r):
    """A decoder-like chain: Clamp + conv(4->64) + ReLU, Block's last conv (+ skip, ReLU), Upsample + conv, stride-2."""
    h = OP(x, w0, None, None, 1, True, 1, True)
    h = OP(h, w1, None, r, 1, True, 1, False)
    h = OP(h, w1, None, None, 1, False, 2, False)
    return OP(h, w2, None, None, 2, True, 1, False)


def test_cuda_graph_capture_replay():
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(2, 4, 11, 13, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w0 = (torch.randn(64, 4, 3, 3, generator=gen, device="cuda") / 6).half()
    w1 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    w2 = (torch.randn(16, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    r = torch.randn(2, 64, 11, 13, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture: compiles, loads, packs the weights
        _chain(x, w0, w1, w2, r)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _chain(x, w0, w1, w2, r)
    for _ in range(2):  # new inputs copied into the captured buffers
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
        r.copy_(torch.randn(r.shape, generator=gen, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        assert not y.isnan().any()
        torch.testing.assert_close(y, _chain(x, w0, w1, w2, r), rtol=0, atol=0)  # same kernels: same bits


def test_compile_fullgraph():
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, r = _make(2, 64, 64, 12, 20, 1, 1, True, True, gen)

    def f(x, r):
        h = OP(x, w, b, r, 1, True, 1, False)
        return OP(h, w, None, None, 1, False, 2, False)

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, r), f(x, r), rtol=0, atol=0)


def test_side_stream():
    gen = torch.Generator(device="cuda").manual_seed(10)
    x, w, b, _ = _make(1, 64, 64, 48, 48, 1, 1, True, False, gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = OP(x, w, b, None, 1, True, 1, False)
    torch.cuda.current_stream().wait_stream(s)
    ref = _reference(x, w, b, None, 1, True, 1, False)
    assert _rel(y, ref) <= 2 * _rel(_torch_f16(x, w, b, None, 1, True, 1, False), ref) + 1e-7


def test_more_than_2_31_elements():
    """Element offsets past 2**31 (int64 in the kernel): check the last rows against an fp32 conv of a crop."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~10 GB of GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(11)
    H, W = 5800, 5824  # 64 * H * W = 2.16e9 elements
    x = torch.empty(1, 64, H, W, device="cuda", dtype=torch.float16, memory_format=CL).normal_(generator=gen)
    w = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b = torch.randn(64, generator=gen, device="cuda").half()
    y = OP(x, w, b, None, 1, True, 1, False)
    assert not y.isnan().any()
    for lo in (0, H - 6):  # rows [lo, lo+6): conv of a crop with one halo row each side (zero padding at the border)
        a, e = max(lo - 1, 0), min(lo + 7, H)
        crop = F.conv2d(x[:, :, a:e].float(), w.float(), b.float(), padding=1).relu()
        ref = crop[:, :, lo - a: lo - a + 6]
        got = y[:, :, lo: lo + 6]
        assert _rel(got, ref.double()) < 1e-3


def test_error_summary(capsys):
    """Prints kernel vs cuDNN f16 errors on TAESD-like layers (for the log)."""
    lines = []
    for name, kw in [("64->64 s1 b+r+relu", dict(stride=1)), ("64->64 s2", dict(stride=2, residual=False)),
                     ("up2 64->64", dict(upsample=2, bias=False, residual=False, relu=False)),
                     ("clamp 4->64", dict(cin=4, residual=False, pre_clamp=True)),
                     ("64->3", dict(cout=3, residual=False, relu=False))]:
        args = dict(B=2, cin=64, cout=64, H=64, W=64, seed=12)
        args.update(kw)
        e, t = _check(**args)
        lines.append(f"{name:22s} kernel {e:.3e}  cuDNN-f16 {t:.3e}  ratio {e / t:.2f}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
