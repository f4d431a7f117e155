"""CPU checks of the Triton tensor-core convs (rows "triton_conv", kernels/triton_conv.py, and "triton_conv_tma",
kernels/triton_conv_tma.py) and the taesd_fast::conv3x3_tc op: argument checks, the PyTorch twin, the upsample-fold
maths, weight packing and its cache, the Gluon kernels' launch-shape searches, and the two Triton kernels themselves
run by Triton's interpreter.

Interpreter: TRITON_INTERPRET=1 must be set before triton is imported, and it would turn every Triton kernel in the
process into Python. So the kernel cases run in one subprocess (this file run as a script with --interpret-cases),
which prints one JSON line per case; the tests here check those lines. Skipped with the reason when triton is missing.

Error bound: relative error ||y - ref|| / ||ref|| against a float64 reference must be <= 2x PyTorch's own f16 error on
the same inputs. On CPU, PyTorch's f16 error is that of the f16 ops the model runs today (clamp, interpolate, conv,
+ residual, ReLU, each in torch.float16). CPU f16 conv is supported and accumulates in fp32 (measured: the same error
as an fp32 conv of the f16 inputs rounded once), so this is the honest "PyTorch f16" baseline on this machine.
Inputs are fresh random normals (never zeros) and the kernel's output is NaN-poisoned before every launch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import interpret_cases, report_cases

from taesd_fast.kernels import conv_contract, conv_launch, conv_op, conv_pack, conv_schedule, triton_conv_tma, gluon_conv_tile
from taesd_fast.kernels import triton_conv as tc

CL = torch.channels_last


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _make(B, cin, cout, H, W, stride=1, upsample=1, bias=True, residual=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cin, H, W, generator=gen).half().contiguous(memory_format=CL)
    w = (torch.randn(cout, cin, 3, 3, generator=gen) / (3 * cin**0.5)).half()
    b = (torch.randn(cout, generator=gen) * 0.5).half() if bias else None
    oshape = tc.output_shape(x.shape, w.shape, stride, upsample)
    r = torch.randn(oshape, generator=gen).half().contiguous(memory_format=CL) if residual else None
    return x, w, b, r


def _reference64(*args):
    return conv_contract.conv3x3_math(*args, dtype=torch.float64)


def _torch_f16(*args):
    """What the model computes today, op by op in f16 (the decoder's Clamp, nn.Upsample, conv, + skip, ReLU)."""
    return conv_contract.conv3x3_math(*args)


# --------------------------------------------------------------------------- no Triton needed


def test_unsupported_reason_and_errors():
    f16 = torch.float16
    assert tc.unsupported_reason((1, 64, 8, 8), (64, 64, 3, 3), f16, 1, 1) is None
    assert tc.unsupported_reason((1, 64, 8, 8), (64, 64, 3, 3), f16, 1, 2) is None
    assert "float16" in tc.unsupported_reason((1, 64, 8, 8), (64, 64, 3, 3), torch.float32, 1)
    assert "3x3" in tc.unsupported_reason((1, 64, 8, 8), (64, 64, 1, 1), f16, 1)
    assert "C_in" in tc.unsupported_reason((1, 32, 8, 8), (64, 64, 3, 3), f16, 1)
    assert "stride" in tc.unsupported_reason((1, 64, 8, 8), (64, 64, 3, 3), f16, 3)
    assert "stride 1" in tc.unsupported_reason((1, 64, 8, 8), (64, 64, 3, 3), f16, 2, 2)
    assert "1..256" in tc.unsupported_reason((1, 512, 8, 8), (64, 512, 3, 3), f16, 1)
    x, w, b, r = _make(1, 16, 8, 5, 6)
    op = torch.ops.taesd_fast.conv3x3_tc
    with pytest.raises(ValueError, match="float16"):
        op(x.float(), w, b, r, 1, True, 1, False)
    with pytest.raises(ValueError, match="residual must have the output shape"):
        op(x, w, b, r[:, :, :-1], 1, True, 1, False)
    with pytest.raises(ValueError, match=r"b must have shape \(8,\)"):
        op(x, w, b[:4], r, 1, True, 1, False)
    with pytest.raises(ValueError, match="upsample=2 needs stride 1"):
        op(x, w, b, None, 2, True, 2, False)


@pytest.mark.parametrize("upsample,stride", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("pre_clamp", [False, True])
def test_cpu_op_is_twin_and_matches_reference(upsample, stride, pre_clamp):
    """On CPU (no interpreter) the op runs the twin: fp32 maths, channels_last output, within 2x PyTorch's f16 error."""
    x, w, b, r = _make(2, 16, 32, 7, 9, stride, upsample, seed=3)
    args = (x, w, b, r, stride, True, upsample, pre_clamp)
    y = torch.ops.taesd_fast.conv3x3_tc(*args)
    assert y.is_contiguous(memory_format=CL) and y.dtype == torch.float16
    assert y.shape == tc.output_shape(x.shape, w.shape, stride, upsample)
    torch.testing.assert_close(y, conv_op.conv3x3_tc_ref(*args), rtol=0, atol=0)
    ref = _reference64(*args)
    assert _rel(y, ref) <= 2 * _rel(_torch_f16(*args), ref) + 1e-7


@pytest.mark.parametrize("H,W", [(1, 1), (4, 5), (7, 3)])
def test_upsample_fold_is_exact_in_fp64(H, W):
    """The 4 phase 2x2 convs on the low-res input equal nearest-2x upsample + 3x3 conv (fp64: exact up to roundoff)."""
    gen = torch.Generator().manual_seed(H * 10 + W)
    x = torch.randn(2, 5, H, W, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 5, 3, 3, generator=gen, dtype=torch.float64)
    want = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, padding=1)
    phases = conv_pack.fold_upsample_weight(w).double()  # fp32 sums of fp64 weights: compare at fp32 precision
    got = torch.empty_like(want)
    xp = F.pad(x, (1, 1, 1, 1))  # low-res zero padding = upsampled zero padding
    for py in range(2):
        for px in range(2):
            # tap (ty, tx) reads x[i + py - 1 + ty, j + px - 1 + tx]: a 2x2 conv over xp offset by (py, px)
            sub = xp[:, :, py: py + H + 1, px: px + W + 1]
            got[:, :, py::2, px::2] = F.conv2d(sub, phases[py * 2 + px])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("c_in,upsample,block_k", [(3, 1, 0), (4, 2, 0), (64, 1, 0), (64, 1, 32), (24, 2, 0), (130, 1, 0)])
def test_pack_weight_layout(c_in, upsample, block_k):
    c_out = 40
    w = torch.randn(c_out, c_in, 3, 3).half()
    plan = conv_pack.plan(c_in, c_out, upsample, block_k)
    wp = conv_pack.pack_weight(w, upsample, plan)
    assert wp.shape == (plan.phases, plan.k_rows, plan.n_pad) and wp.dtype == torch.float16
    full = conv_pack.fold_upsample_weight(w) if upsample == 2 else w.float().unsqueeze(0)
    ks = plan.ks
    for p in range(plan.phases):
        for ky in range(ks):
            for kx in range(ks):
                tap = ky * ks + kx
                row0 = tap * (c_in if plan.flat else plan.cin_pad)
                block = wp[p, row0: row0 + c_in, :c_out].float()
                torch.testing.assert_close(block, full[p, :, :, ky, kx].t().half().float(), rtol=0, atol=0)
    assert wp[:, :, c_out:].abs().sum() == 0  # padded columns are zero
    if plan.flat:
        assert wp[:, ks * ks * c_in:].abs().sum() == 0  # padded K rows are zero
    else:
        assert wp.view(plan.phases, ks * ks, plan.cin_pad, plan.n_pad)[:, :, c_in:].abs().sum() == 0


def test_pack_cache_sees_in_place_updates():
    from taesd_fast.kernels.derived import derived

    w = torch.randn(8, 16, 3, 3).half()
    plan = conv_pack.plan(16, 8, 1)
    calls = []

    def build():
        calls.append(1)
        return conv_pack.pack_weight(w, 1, plan)

    a = derived.get(w, ("t", plan), build)
    assert derived.get(w, ("t", plan), build) is a and len(calls) == 1
    with torch.no_grad():
        w.mul_(2)  # bumps the version counter
    c = derived.get(w, ("t", plan), build)
    assert len(calls) == 2 and torch.equal(c.float(), 2 * a.float())
    # packed_weight: the launch's view of the same cache, saying whether it packed in this call (then no PDL)
    wp, packed_now = conv_pack.packed_weight(w, 1, plan)
    assert packed_now and torch.equal(wp, conv_pack.pack_weight(w, 1, plan))
    wp2, packed_now = conv_pack.packed_weight(w, 1, plan)
    assert wp2 is wp and not packed_now


def test_default_config_is_deterministic():
    big = tc.default_config(64, 64, 1, 1, 64 * 256 * 256)
    assert big == tc.default_config(64, 64, 1, 1, 64 * 256 * 256) and big.block_m == 128
    assert tc.default_config(64, 64, 1, 1, 2 * 32 * 32).block_m == 64  # too few tiles for 128: fill the SMs
    assert tc.default_config(3, 64, 1, 1, 64 * 256 * 256).num_stages == 2  # flat mode: one K step to pipeline
    assert tc.default_config(64, 160, 1, 1, 64 * 256 * 256).num_warps == 8  # 128-wide N tiles


def test_upsample_latency_kernel_rows_fill_one_wave():
    """gluon_conv_up: the fewest low-res rows per program that keep the grid to one wave (2 row parities x strips of 64
    columns x row tiles); None where even 4 rows need a second wave (the launcher then takes the TMA kernel)."""
    from taesd_fast.kernels import gluon_conv_up

    assert gluon_conv_up.rows_per_program(1, 32, 32, 132) == 1  # 64^2 output: 64 programs
    assert gluon_conv_up.rows_per_program(1, 64, 64, 132) == 1  # 128^2: 128 programs
    assert gluon_conv_up.rows_per_program(1, 128, 128, 132) == 4  # 256^2: 128 programs
    assert gluon_conv_up.rows_per_program(1, 100, 64, 132) == 2
    assert gluon_conv_up.rows_per_program(1, 256, 256, 132) is None  # 512^2
    assert gluon_conv_up.rows_per_program(16, 32, 32, 132) is None


def test_narrow_latency_kernel_rows_fill_one_wave():
    """gluon_conv_narrow: whole rows (W <= 256) per program, the fewest rows that keep the grid to one wave (one program
    per SM) within the shared-memory budget; None where that cannot be had."""
    from taesd_fast.kernels import gluon_conv_narrow

    assert gluon_conv_narrow.rows_per_program(1, 256, 256, 3, 132) == 2  # the decoder's last conv at 256^2: 128 programs
    assert gluon_conv_narrow.rows_per_program(1, 128, 128, 3, 132) == 1
    assert gluon_conv_narrow.rows_per_program(1, 300, 64, 3, 132) == 4
    assert gluon_conv_narrow.rows_per_program(1, 600, 64, 3, 132) is None  # 150 programs of 4 rows
    assert gluon_conv_narrow.rows_per_program(1, 300, 256, 7, 132) == 4  # 6 rows of 32 KB (+ weights, scratch) fit
    assert gluon_conv_narrow.rows_per_program(16, 256, 256, 3, 132) is None
    assert gluon_conv_narrow.rows_per_program(1, 256, 256, 3, 60) is None  # even 4-row programs (64) exceed 60 SMs
    assert [gluon_conv_narrow.row_width(w) for w in (1, 40, 64, 65, 200, 256)] == [64, 64, 64, 128, 256, 256]
    assert [gluon_conv_narrow.n_pad(c) for c in (1, 3, 5, 6, 7)] == [16, 16, 16, 32, 32]


@pytest.mark.parametrize("c_out", [1, 3, 7])
def test_narrow_kernel_maths_is_the_conv(c_out):
    """gluon_conv_narrow's formulation, in float64 on the packed weight: per output row, the three dy taps as [W, 64] @
    [64, N] products (column dx * c_out + o), then column n read from pixel x + dx - 1 (zero outside the row).
    Must equal the 3x3 conv of the same f16-rounded weight to float64 rounding."""
    from taesd_fast.kernels import gluon_conv_narrow

    gen = torch.Generator().manual_seed(c_out)
    B, H, W = 2, 5, 9
    x = torch.randn(B, 64, H, W, generator=gen, dtype=torch.float64)
    w = torch.randn(c_out, 64, 3, 3, generator=gen).half()
    wn = gluon_conv_narrow.pack(w).double()  # [3 * 64, n_pad]
    assert wn.shape == (192, gluon_conv_narrow.n_pad(c_out))
    rows = F.pad(x, (0, 0, 1, 1)).permute(0, 2, 3, 1)  # [B, H + 2, W, 64]: the zero rows above and below
    p = sum(rows[:, dy:dy + H] @ wn[64 * dy:64 * (dy + 1)] for dy in range(3))  # [B, H, W, n_pad]
    p = F.pad(p, (0, 0, 1, 1))  # pixel -1 and W read zero
    y = sum(p[:, :, dx:dx + W, dx * c_out:(dx + 1) * c_out] for dx in range(3)).permute(0, 3, 1, 2)
    ref = F.conv2d(x, w.double(), padding=1)
    assert torch.allclose(y, ref, rtol=0, atol=1e-10), (y - ref).abs().max()


def test_latency_kernel_tiles_fill_one_wave():
    """Half the channels per program while the programs fill at most half the SMs, two rows where one-row tiles
    would need a second wave."""
    assert gluon_conv_tile.tile_shape(1, 32, 32, 132) == (1, 32)  # 32 one-row tiles: 64 programs
    assert gluon_conv_tile.tile_shape(1, 64, 64, 132) == (1, 64)
    assert gluon_conv_tile.tile_shape(1, 128, 128, 132) == (2, 64)  # 256 one-row tiles: 128 two-row ones


@pytest.mark.parametrize("B,H,strips", [(64, 256, 2), (64, 128, 1), (1, 1024, 8), (1, 512, 4), (16, 128, 1),
                                        (1, 1, 1), (3, 37, 1)])
def test_row_streaming_programs_fill_the_gpu(B, H, strips):
    rows = conv_schedule.rows_per_program(B, H, strips, 132)
    programs = B * strips * -(-H // rows)
    assert 1 <= rows <= H
    assert programs <= 132 or rows <= 8  # one wave, unless chunks would get so short that halo rows dominate
    if B * strips >= 132:
        assert rows == H  # the GPU is full with whole columns: no chunk re-reads halo rows


def test_tma_variant_says_where_it_does_not_apply():
    """The TMA kernel's own limits (beyond the conv contract); each reason names the limit."""
    cpu = torch.device("cpu")
    assert triton_conv_tma.unsupported_reason(64, 1, False, 64, 16, 128, cpu) is None
    assert "stride 2" in triton_conv_tma.unsupported_reason(64, 2, False, 64, 16, 128, cpu)
    assert "pre_clamp" in triton_conv_tma.unsupported_reason(64, 1, True, 64, 16, 128, cpu)
    assert "multiple of block_k" in triton_conv_tma.unsupported_reason(48, 1, False, 64, 16, 128, cpu)
    assert "tile_w" in triton_conv_tma.unsupported_reason(64, 1, False, 64, 12, 128, cpu)
    x, w, b, r = _make(1, 48, 64, 5, 6, residual=False)
    with pytest.raises(ValueError, match="multiple of block_k"):  # the launch refuses what the rule refuses
        triton_conv_tma.conv3x3_tma_launch(x, w, b, None, 1, True)


def test_tma_config_follows_the_grid():
    """triton_conv_tma keeps two-stage 128-wide channel blocks where its programs give every SM one, and takes 64-wide
    blocks, four stages deep, below that (one frame of TAEHV's 256-channel stage at 44x80: 30 tiles, 60 programs)."""
    cpu = torch.device("cpu")
    base = triton_conv_tma.default_config(256)
    assert (base.block_n, base.num_stages) == (0, 2)
    assert triton_conv_tma.shape_config(256, (23, 256, 44, 80), 1, cpu) == base
    assert triton_conv_tma.shape_config(256, (1, 256, 44, 80), 1, cpu) == triton_conv_tma.TMAConfig(
        128, 4, 4, 16, block_n=64)
    assert triton_conv_tma.shape_config(64, (1, 64, 44, 80), 1, cpu) == triton_conv_tma.default_config(64)
    assert triton_conv_tma.grid_tiles((1, 256, 44, 80), 2) == 4 * 6 * 5  # per phase of the upsample fold


def test_tma_one_row_tiles_where_the_width_allows():
    """row_config: 128-pixel one-row tiles with TMA weight loads for 64 output channels at widths that are multiples
    of 128 (stride 1, or the upsample fold's low-res width), not at narrower outputs or other widths; for more
    channels on small grids only (TAEHV's one-frame step), 128-wide channel blocks, 64-pixel tiles at a width of 64."""
    cpu, T = torch.device("cpu"), triton_conv_tma
    row128 = T.TMAConfig(128, 4, 3, 128, weight_tma=True)
    assert T.shape_config(64, (1, 64, 256, 256), 1, cpu) == row128
    assert T.shape_config(64, (4, 64, 160, 256), 2, cpu) == row128  # the fold's grid is the input's
    assert T.shape_config(64, (62, 64, 176, 320), 1, cpu) == T.default_config(64)  # 320: 64-pixel tiles lost
    assert T.shape_config(64, (64, 64, 64, 64), 1, cpu) == T.default_config(64)
    assert T.shape_config(3, (4, 64, 320, 512), 1, cpu) == T.default_config(3)  # narrow outputs lost
    assert T.shape_config(256, (1, 256, 40, 64), 1, cpu) == T.TMAConfig(64, 4, 3, 64, block_n=128, weight_tma=True)
    assert T.shape_config(128, (1, 128, 80, 128), 1, cpu) == T.TMAConfig(128, 4, 3, 128, block_n=128,
                                                                        weight_tma=True)
    assert T.shape_config(256, (16, 256, 40, 64), 1, cpu) == T.default_config(256)  # a full grid: unchanged
    assert T.shape_config(256, (1, 256, 44, 80), 1, cpu).tile_w == 16  # 80 is no multiple of 64


def test_tma_operands_are_copied_to_an_aligned_base():
    """TMA needs a 16-byte aligned base: a channels_last view starting 2 bytes into its buffer is copied (same
    values), an aligned one is used as it is."""
    buf = torch.randn(2 * 8 * 8 * 64 + 1).half()
    x = buf[1:].view(2, 8, 8, 64).permute(0, 3, 1, 2)
    assert x.is_contiguous(memory_format=CL) and x.data_ptr() % 16
    call = conv_launch.prepare("t", x, torch.randn(64, 64, 3, 3).half(), None, None, 1, tma=True)
    assert call.x.data_ptr() % 16 == 0 and call.x.is_contiguous(memory_format=CL) and torch.equal(call.x, x)
    aligned = x.clone(memory_format=CL)
    assert conv_launch.prepare("t", aligned, torch.randn(64, 64, 3, 3).half(), None, None, 1, tma=True).x is aligned


def test_row_helpers_on_cpu():
    """The row's spec functions: a CPU spec is refused before anything compiles, and nothing ran yet; run on CPU is
    the op's twin (the kernel itself runs under the interpreter below)."""
    from taesd_fast.dispatch import Spec

    spec = Spec("conv2d", "cpu", (1, 64, 8, 8), (64, 64, 3, 3), torch.float16, 1, True, False, True, "channels_last")
    assert tc.spec_unsupported_reason(spec) == "CPU tensor"
    assert triton_conv_tma.spec_unsupported_reason(spec) == "CPU tensor"
    assert not tc.spec_ready(spec) and not triton_conv_tma.spec_ready(spec)
    x, w, b, r = _make(1, 16, 8, 5, 6, seed=2)
    torch.testing.assert_close(tc.run(x, w, b, 1, r, True), conv_op.conv3x3_tc_ref(x, w, b, r, 1, True), rtol=0, atol=0)


def test_opcheck_cpu():
    x, w, b, r = _make(2, 16, 8, 5, 6, seed=1)
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_tc.default, (x, w, b, r, 1, True, 1, False))
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_tc.default, (x, w, None, None, 1, False, 2, True))
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_tc.default, (x, w, b, r, 1, True, 1, False, "gluon_conv_tile"))


def test_rows_trace_through_the_op_under_torch_compile():
    """While torch.compile traces, a row's run is the conv3x3_tc op naming that row (a graph node, not a launch);
    on CPU the compiled graph then runs the op's twin. fullgraph: no break around the kernels."""
    from taesd_fast.kernels import gluon_conv_rows

    x, w, b, r = _make(1, 64, 64, 5, 6, seed=4)
    seen = []
    real = torch.ops.taesd_fast.conv3x3_tc.default

    def backend(gm, example_inputs):
        seen.extend(n.args[-1] for n in gm.graph.nodes if n.target in (real, torch.ops.taesd_fast.conv3x3_tc))
        return gm

    for row in (tc, triton_conv_tma, gluon_conv_rows):
        torch._dynamo.reset()
        fn = torch.compile(lambda x, r, row=row: row.run(x, w, b, 1, r, True), backend=backend, fullgraph=True)
        torch.testing.assert_close(fn(x, r), conv_op.conv3x3_tc_ref(x, w, b, r, 1, True), rtol=0, atol=0)
    assert seen == ["triton_conv", "triton_conv_tma", "gluon_conv_rows"]


def test_op_names_only_conv_rows():
    """The op's variant names a conv2d kernel row; anything else is a clear error, not another kernel."""
    assert conv_op.launcher("triton_conv") is tc.launch_conv  # each module registers its launch as it loads
    assert conv_op.launcher("triton_conv_tma") is triton_conv_tma.launch_conv
    assert conv_op.launcher("gluon_conv_tile") is gluon_conv_tile.launch_conv
    for bad in ("tc", "simt_f16_tile", "split_bf16"):
        with pytest.raises(ValueError, match="is not a loaded tensor-core conv row"):
            conv_op.launcher(bad)


# --------------------------------------------------------------------------- the kernel, under the interpreter

# (B, C_in, C_out, H, W, stride, upsample, bias, residual, relu, pre_clamp, config or None, layout). Names starting
# with "tma" run the TMA kernel (triton_conv_tma; config = TMAConfig fields), the others the pointer kernel (triton_conv;
# config = TCConfig fields). Without a config the case goes through the row's run (on CPU: the conv3x3_tc op naming
# the row's variant).
CASES = {
    "64to64_s1_full": (1, 64, 64, 7, 9, 1, 1, True, True, True, False, None, "cl"),
    "3to64_flat": (2, 3, 64, 7, 9, 1, 1, True, False, True, False, None, "cl"),
    "4to64_preclamp": (1, 4, 64, 7, 9, 1, 1, True, False, True, True, None, "cl"),
    "16to64_preclamp": (1, 16, 64, 5, 7, 1, 1, True, False, True, True, None, "cl"),
    "64to3_last": (2, 64, 3, 7, 9, 1, 1, True, False, False, False, None, "cl"),
    "64to64_s2_nobias": (1, 64, 64, 9, 7, 2, 1, False, False, False, False, None, "cl"),
    "3to16_flat_s2": (2, 3, 16, 9, 9, 2, 1, True, True, True, False, None, "cl"),
    "64to64_up2": (1, 64, 64, 5, 7, 1, 2, False, False, False, False, None, "cl"),
    "16to4_up2_full": (2, 16, 4, 4, 5, 1, 2, True, True, True, False, None, "cl"),
    "4to16_up2_flat_preclamp": (1, 4, 16, 3, 5, 1, 2, True, False, False, True, None, "cl"),
    "64to16_1x1_image": (1, 64, 16, 1, 1, 1, 1, False, True, False, False, None, "cl"),
    "32to64_res_relu": (2, 32, 64, 6, 11, 1, 1, False, True, True, False, None, "cl"),
    "24to40_masks": (1, 24, 40, 5, 6, 1, 1, True, True, True, False, None, "cl"),
    "64to64_chunks_bm16": (1, 64, 64, 7, 9, 1, 1, True, True, True, False, (16, 4, 2, 32), "cl"),
    "128to160_ntiles": (1, 128, 160, 5, 5, 2, 1, True, True, True, False, None, "cl"),
    "64to64_up2_bm16": (1, 64, 64, 3, 7, 1, 2, True, True, True, True, (16, 4, 2, 16), "cl"),
    "64to64_l1_cached_loads": (1, 64, 64, 6, 5, 1, 1, True, True, True, False, (16, 4, 2, 0, True), "cl"),
    "nchw_input": (2, 16, 16, 5, 6, 1, 1, True, True, True, False, None, "nchw"),
    # TMA kernel (2-D tiles; boxes past the image edges are zero-filled): tiles straddle every edge here
    "tma_row_default": (1, 64, 64, 7, 9, 1, 1, True, True, True, False, None, "cl"),
    "tma_row_up2": (1, 32, 64, 4, 6, 1, 2, True, False, True, False, None, "cl"),
    "tma_64to64_res": (2, 64, 64, 7, 9, 1, 1, True, True, True, False, (32, 4, 2, 8), "cl"),
    "tma_32to64_up2": (2, 32, 64, 5, 11, 1, 2, False, False, False, False, (16, 4, 2, 8), "cl"),
    "tma_128to160_ntiles": (1, 128, 160, 5, 6, 1, 1, True, True, True, False, (32, 4, 2, 16), "cl"),
    "tma_64to3": (1, 64, 3, 6, 5, 1, 1, True, False, False, False, (64, 4, 2, 16), "cl"),
    "tma_persistent_up2": (2, 64, 64, 9, 7, 1, 2, True, True, True, False, (16, 4, 2, 8, 1), "cl"),
    "tma_nchw_input": (1, 16, 32, 5, 6, 1, 1, True, True, False, False, None, "nchw"),
    "tma_256to256_small_grid_default": (1, 32, 256, 4, 6, 1, 1, True, True, True, False, None, "cl"),
    "tma_128to192_64_wide_blocks": (1, 64, 192, 5, 6, 1, 1, True, True, True, False, (32, 4, 3, 8, 0, 64), "cl"),
    # one-row tiles with TMA weight loads (row_config), rows and columns past the edges
    "tma_one_row_weight_tma": (2, 64, 64, 3, 20, 1, 1, True, True, True, False, (16, 4, 3, 16, 0, 0, True), "cl"),
    "tma_one_row_up2_blocks": (1, 64, 256, 2, 12, 1, 2, True, False, True, False, (16, 4, 3, 16, 0, 128, True), "cl"),
    "tma_weight_tma_2d_tiles": (1, 32, 48, 5, 6, 1, 1, True, True, True, False, (16, 4, 2, 8, 0, 0, True), "cl"),
    "tma_row_config_default": (1, 64, 64, 2, 128, 1, 1, True, True, True, False, None, "cl"),
}

# TAEHV's TGrow folded into the TMA conv after it (triton_conv_tma.grow_launch): (B, C, C_out, H, W, grow, upsample,
# bias, relu, TMAConfig fields or None). Output frame (i, t) reads input frame i with weight group t.
GROW_CASES = {
    "grow2_up2_default": (2, 32, 64, 3, 5, 2, 2, True, True, None),
    "grow2_up2_one_row": (1, 64, 64, 2, 16, 2, 2, True, False, (16, 4, 3, 16, 0, 0, True)),
    "grow3_no_upsample_2d_tiles": (2, 32, 48, 5, 6, 3, 1, False, True, (16, 4, 2, 8)),
    "grow1_up2_blocks": (1, 64, 256, 2, 12, 1, 2, True, True, (16, 4, 3, 16, 0, 128, True)),
}


def _run_case(name: str) -> dict:
    """Child side: run one case through its row (or the launcher for explicit configs), compare, report."""
    B, cin, cout, H, W, stride, up, bias, res, relu, pre_clamp, cfg, layout = CASES[name]
    x, w, b, r = _make(B, cin, cout, H, W, stride, up, bias, res, seed=len(name) * 7919 + cin)
    if layout == "nchw":
        x, r = x.contiguous(), None if r is None else r.contiguous()
    args = (x, w, b, r, stride, relu, up, pre_clamp)
    tma = name.startswith("tma")
    before = set(conv_launch._launched)
    if cfg is None:
        y = (triton_conv_tma if tma else tc).run(x, w, b, stride, r, relu, up, pre_clamp)
    elif tma:
        y = triton_conv_tma.conv3x3_tma_launch(*args, config=triton_conv_tma.TMAConfig(*cfg))
    else:
        y = tc.conv3x3_tc_launch(*args, config=tc.TCConfig(*cfg))
    ran = sorted({k[0] for k in set(conv_launch._launched) - before})
    ref = _reference64(*args)
    out = {"name": name, "nan": bool(y.isnan().any()), "cl": y.is_contiguous(memory_format=CL),
           "shape_ok": tuple(y.shape) == tuple(ref.shape), "err": _rel(y, ref),
           "torch_err": _rel(_torch_f16(*args), ref), "ran": ran}
    if layout == "nchw":  # converted on the way in: the same bits as the channels_last input
        cl_args = (x.contiguous(memory_format=CL), w, b, None if r is None else r.contiguous(memory_format=CL),
                   *args[4:])
        row = triton_conv_tma if tma else tc
        out["same_as_cl"] = bool(torch.equal(row.run(cl_args[0], w, b, stride, cl_args[3], relu, up, pre_clamp), y))
    return out


def _make_grow(B, c, cout, H, W, grow, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, c, H, W, generator=gen).half().contiguous(memory_format=CL)
    gw = (torch.randn(grow * c, c, 1, 1, generator=gen) / c**0.5).half()
    w = (torch.randn(cout, c, 3, 3, generator=gen) / (3 * c**0.5)).half()
    b = (torch.randn(cout, generator=gen) * 0.5).half() if bias else None
    return x, gw, w, b


def _grown_then_conv(x, gw, w, b, grow, relu, up, dtype=None):
    """TGrow (1x1 conv, channel group t -> frame t of each input frame), then the conv contract, in `dtype`
    (default: x's), op by op as the model runs them without the fold."""
    dtype = dtype or x.dtype
    B, c, H, W = x.shape
    g = torch.nn.functional.conv2d(x.to(dtype), gw.to(dtype)).view(B, grow, c, H, W).reshape(B * grow, c, H, W)
    return conv_contract.conv3x3_math(g, w, b, None, 1, relu, up, dtype=dtype)


def _run_grow_case(name: str) -> dict:
    B, c, cout, H, W, grow, up, bias, relu, cfg = GROW_CASES[name]
    x, gw, w, b = _make_grow(B, c, cout, H, W, grow, bias, seed=len(name) * 7919 + c)
    before = set(conv_launch._launched)
    config = None if cfg is None else triton_conv_tma.TMAConfig(*cfg)
    y = triton_conv_tma.grow_launch(x, gw, w, b, grow, relu, up, config=config)
    ran = sorted({k[0] for k in set(conv_launch._launched) - before})
    ref = _grown_then_conv(x, gw, w, b, grow, relu, up, torch.float64)
    return {"name": name, "nan": bool(y.isnan().any()), "cl": y.is_contiguous(memory_format=CL),
            "shape_ok": tuple(y.shape) == tuple(ref.shape), "err": _rel(y, ref),
            "torch_err": _rel(_grown_then_conv(x, gw, w, b, grow, relu, up), ref), "ran": ran}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    conv_contract.POISON_OUTPUT = True
    report_cases(CASES, _run_case)
    report_cases(GROW_CASES, _run_grow_case)
    print(json.dumps({"name": "__launched__", "count": len(conv_launch._launched)}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpret_cases(__file__, expected=[*CASES, *GROW_CASES, "__launched__"], timeout=240)


@pytest.mark.parametrize("name", list(GROW_CASES))
def test_grow_fold_interpreted(interpreted, name):
    """TGrow folded into the TMA conv: every element written (NaN-poisoned output), TGrow's frame order, and within
    2x the error of TGrow + conv in f16 against the float64 TGrow + conv."""
    d = interpreted[name]
    assert "error" not in d, d.get("error")
    assert d["shape_ok"] and d["cl"], d
    assert not d["nan"], "unwritten (NaN-poisoned) output elements"
    assert d["err"] <= 2 * d["torch_err"] + 1e-7, f"rel err {d['err']:.3g} > 2 x PyTorch f16 error {d['torch_err']:.3g}"
    assert d["ran"] == ["triton_conv_tma"], d["ran"]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interpreted, name):
    d = interpreted[name]
    assert "error" not in d, d.get("error")
    assert d["shape_ok"] and d["cl"], d
    assert not d["nan"], "unwritten (NaN-poisoned) output elements"
    assert d["err"] <= 2 * d["torch_err"] + 1e-7, f"rel err {d['err']:.3g} > 2 x PyTorch f16 error {d['torch_err']:.3g}"
    if "same_as_cl" in d:
        assert d["same_as_cl"]
    want = "triton_conv_tma" if name.startswith("tma") else "triton_conv"
    assert d["ran"] == [want], f"expected exactly the {want} kernel to launch, recorded {d['ran']}"


def test_interpreter_really_ran_the_kernel(interpreted):
    n_cfg = sum(1 for c in CASES.values() if c[11] is None)
    assert interpreted["__launched__"]["count"] >= n_cfg // 2  # distinct compile keys launched through Triton


if __name__ == "__main__" and "--interpret-cases" in sys.argv:
    _child_main()

