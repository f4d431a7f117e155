"""Every conv2d kernel row on the GPU, each through its own `run` (kernels/rows.py): first one table-driven check
per row, then the Hopper rows in depth: the row-streaming kernels (gluon_conv_rows, kernels/gluon_conv_rows.py, and
cuda_conv_rows, kernels/cuda_conv_rows.py) and the latency kernels for small images (gluon_conv_tile, gluon_conv_up,
gluon_conv_narrow). The Triton rows are covered in depth by test_conv_tc_gpu.py, the SIMT ones by
test_conv_kernels.py.

Same bound as test_conv_tc_gpu: rel err vs float64 <= 2x cuDNN's own f16 error on the same inputs, NaN-poisoned
outputs, fresh random inputs. Every case asserts the kernel under test really ran (with one row per kernel there is
no fallback, but a mistaken route would pass the numeric checks too). Row chunks are forced small in some cases so
that chunk boundaries (the two halo rows each chunk re-reads), partial last chunks and several strips per image are
all exercised. Calls outside a row's rule raise ValueError naming the limit.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from error_bounds import assert_conv_within

from taesd_fast.dispatch import Spec, table
from taesd_fast.kernels import simt_conv, conv_contract, gluon_conv_rows, conv_launch, gluon_conv_narrow, cuda_conv_rows, gluon_conv_tile, gluon_conv_up
from taesd_fast.kernels import tma_pdl

CL = torch.channels_last


def _spec(x_shape, c_out=64, upsample=1, residual=False, layout="channels_last", stride=1) -> Spec:
    return Spec("conv2d", "cuda:0", tuple(x_shape), (c_out, x_shape[1], 3, 3), torch.float16, stride, True, residual,
                True, layout, upsample, False)


_PROBE = _spec((1, 64, 8, 64))
_REASON = "CUDA is not available" if not torch.cuda.is_available() else gluon_conv_rows.spec_unsupported_reason(_PROBE)
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"the Hopper conv rows are unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32"),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)
    monkeypatch.setattr(simt_conv, "POISON_OUTPUT", True)


def _count_launches(module, monkeypatch) -> list:
    calls = []
    real = module.launch

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(module, "launch", counting)
    return calls


def _counting(module):
    """A fixture: the list of `module.launch` calls during the test (the kernel under test really ran)."""

    @pytest.fixture
    def fixture(monkeypatch):
        return _count_launches(module, monkeypatch)

    return fixture


launches = _counting(gluon_conv_rows)
row_launches = _counting(cuda_conv_rows)
tile_launches = _counting(gluon_conv_tile)
up_launches = _counting(gluon_conv_up)
narrow_launches = _counting(gluon_conv_narrow)


def _make(B, H, W, bias, residual, gen, cout=64):
    x = torch.randn(B, 64, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w = (torch.randn(cout, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b = (torch.randn(cout, generator=gen, device="cuda") * 0.5).half() if bias else None
    r = torch.randn(B, cout, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL) if residual else None
    return x, w, b, r


def _run(module, x, w, b, r, relu, upsample=1):
    """The row's run: the dispatcher's conv2d signature (x, w, b, stride, residual, relu, upsample, pre_clamp)."""
    return module.run(x, w, b, 1, r, relu, upsample, False)


def _check(module, B, H, W, bias, residual, relu, seed, launches, cout=64, upsample=1):
    """One call of the row on fresh inputs: the kernel under test ran (launches) and is within the bound."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w, b, r = _make(B, H, W, bias, residual, gen, cout)
    if residual and upsample == 2:
        r = torch.randn(B, cout, 2 * H, 2 * W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    y = _run(module, x, w, b, r, relu, upsample)
    assert launches, "the kernel under test did not run"
    assert_conv_within(y, (x, w, b, r, 1, relu, upsample, False))


# --------------------------------------------------------------------------- every row, one call each

# (row, x shape, C_out, upsample, residual, layout): a shape inside each row's rule
ROW_CASES = [
    ("triton_conv", (2, 32, 19, 23), 64, 1, True, "channels_last"),
    ("triton_conv_tma", (2, 64, 17, 30), 64, 2, False, "channels_last"),
    ("gluon_conv_rows", (2, 64, 21, 150), 64, 1, True, "channels_last"),
    ("gluon_conv_tile", (1, 64, 32, 40), 64, 1, True, "channels_last"),
    ("gluon_conv_up", (1, 64, 32, 32), 64, 2, False, "channels_last"),
    ("gluon_conv_narrow", (1, 64, 64, 64), 3, 1, False, "channels_last"),
    ("cuda_conv_rows", (1, 64, 64, 256), 64, 1, True, "channels_last"),
    ("simt_f16_tile", (2, 16, 19, 23), 32, 1, True, "nchw"),
    ("simt_f16_ocb4", (2, 16, 19, 23), 32, 1, True, "nchw"),
    ("simt_f16_rb", (2, 16, 19, 23), 32, 1, True, "nchw"),
]


@pytest.mark.parametrize("name,x_shape,c_out,upsample,residual,layout", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_each_row_runs_its_own_kernel_within_the_bound(name, x_shape, c_out, upsample, residual, layout):
    """The row accepts the call, its run is within the bound with poisoned outputs, and afterwards the row is ready
    (compiled and loaded: what a CUDA-graph capture needs). The tensor-core rows record their launches: exactly
    this row's kernel ran."""
    row = table.row("conv2d", name)
    spec = _spec(x_shape, c_out, upsample, residual, layout)
    why = row.supports(spec)
    if why is not None and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{name} does not run on this GPU: {why}")
    assert why is None, f"{name} must accept this call on an sm_90 GPU: {why}"
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    B, c_in, H, W = x_shape
    fmt = CL if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(x_shape, generator=gen, device="cuda").half().contiguous(memory_format=fmt)
    w = (torch.randn(c_out, c_in, 3, 3, generator=gen, device="cuda") / (3 * c_in**0.5)).half()
    b = (torch.randn(c_out, generator=gen, device="cuda") * 0.5).half()
    Ho, Wo = (2 * H, 2 * W) if upsample == 2 else (H, W)
    r = torch.randn(B, c_out, Ho, Wo, generator=gen, device="cuda").half().contiguous(memory_format=fmt) if residual else None
    before = set(conv_launch._launched)
    y = row.run(x, w, b, 1, r, True, upsample, False)
    torch.cuda.synchronize()
    assert_conv_within(y, (x, w, b, r, 1, True, upsample, False))
    if not name.startswith("simt"):
        assert {k[0] for k in set(conv_launch._launched) - before} <= {name}
        assert y.is_contiguous(memory_format=CL)
    assert row.ready(spec), "launched once, the row must report itself ready for graph capture"


# --------------------------------------------------------------------------- the row-streaming kernel (gluon_conv_rows)


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("W", [64, 150])  # one warpgroup per strip (W <= 64), two (wider)
def test_epilogues(bias, residual, relu, W, launches):
    _check(gluon_conv_rows, 2, 21, W, bias, residual, relu, seed=int(bias) + 2 * residual + 4 * relu, launches=launches)


@pytest.mark.parametrize("B,H,W,rows", [(1, 1, 64, None), (1, 2, 64, None), (3, 37, 77, 5), (2, 64, 128, 7),
                                        (1, 40, 300, 3), (2, 9, 200, 1), (1, 130, 70, None), (5, 16, 64, None),
                                        (1, 512, 512, None)])
def test_shapes_and_row_chunks(B, H, W, rows, launches, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(gluon_conv_rows, "rows_per_program", lambda *a: rows)
    _check(gluon_conv_rows, B, H, W, True, True, True, seed=B * 1000 + H * 10 + W, launches=launches)


@pytest.mark.parametrize("cout", [3, 16])
@pytest.mark.parametrize("B,H,W,rows", [(2, 21, 150, None), (1, 40, 300, 3), (3, 9, 64, 2)])
def test_narrow_outputs(cout, B, H, W, rows, launches, monkeypatch):
    """64->3 (the decoder's last conv): N padded to 16, masked stores instead of TMA stores."""
    if rows is not None:
        monkeypatch.setattr(gluon_conv_rows, "rows_per_program", lambda *a: rows)
    _check(gluon_conv_rows, B, H, W, True, False, cout == 16, seed=cout + H, launches=launches, cout=cout)


@pytest.mark.parametrize("W,cout,residual,limit", [(32, 64, True, "W=32"), (1, 64, False, "W=1"),
                                                   (100, 3, True, "with a residual"), (100, 32, False, "64->32")])
def test_refuses_what_it_does_not_cover(W, cout, residual, limit, launches):
    """Narrow images, 64->3 with a residual and other channel counts: the rule refuses them, and so does the
    launch, with the limit in the message (the dispatcher never sends them; a direct caller learns why)."""
    gen = torch.Generator(device="cuda").manual_seed(W)
    x, w, b, r = _make(2, 7, W, True, residual, gen, cout)
    assert limit in gluon_conv_rows.spec_unsupported_reason(_spec(x.shape, cout, residual=residual))
    with pytest.raises(ValueError, match=limit):
        _run(gluon_conv_rows, x, w, b, r, True)
    assert not launches


def test_misaligned_input_is_copied_for_tma(launches):
    """TMA needs a 16-byte aligned base: a channels_last view 2 bytes into its buffer runs on an aligned copy."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    buf = torch.randn(2 * 9 * 96 * 64 + 1, generator=gen, device="cuda").half()
    x = buf[1:].view(2, 9, 96, 64).permute(0, 3, 1, 2)
    assert x.is_contiguous(memory_format=CL) and x.data_ptr() % 16
    w = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    y = _run(gluon_conv_rows, x, w, None, None, True)
    assert launches and launches[0] == x.shape
    assert_conv_within(y, (x, w, None, None, 1, True, 1, False))
    assert tma_pdl.aligned_nhwc(x).data_ptr() % 16 == 0


def test_graph_capture_replays_new_inputs(launches):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, w, b, r = _make(4, 32, 96, True, True, gen)
    _run(gluon_conv_rows, x, w, b, r, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _run(gluon_conv_rows, x, w, b, r, True)
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    graph.replay()
    assert len(launches) == 2
    assert_conv_within(y, (x, w, b, r, 1, True, 1, False))


# --------------------------------------------------------------------------- the latency kernel (gluon_conv_tile)


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("B,H", [(2, 17), (1, 9)])  # all 64 channels per program; half (a small grid)
def test_small_tile_epilogues(bias, residual, relu, B, H, tile_launches):
    # 64-column tiles over 40 columns: zero fill, clipped stores
    _check(gluon_conv_tile, B, H, 40, bias, residual, relu, seed=100 * H + int(bias) + 2 * residual + 4 * relu,
           launches=tile_launches)


@pytest.mark.parametrize("B,H,W,tile", [(1, 32, 32, (1, 32)), (1, 64, 64, (1, 64)), (1, 128, 128, (2, 64)),
                                        (3, 7, 20, (1, 32)), (2, 9, 16, (1, 32)), (1, 1, 64, (1, 32)),
                                        (1, 33, 97, (1, 64)), (4, 5, 33, (1, 32)), (3, 45, 100, (2, 64)),
                                        (8, 64, 64, (2, 64))])
def test_small_tile_shapes(B, H, W, tile, tile_launches):
    """Each tile shape (rows x channels per program: 1 x 32, 1 x 64, 2 x 64), a half-filled last tile row
    (3 x 45 x 100), narrow images, partial tiles at the right edge, and a grid of several waves (8 x 64^2)."""
    assert gluon_conv_tile.tile_shape(B, H, W, 132) == tile
    _check(gluon_conv_tile, B, H, W, True, True, True, seed=B * 1000 + H * 10 + W, launches=tile_launches)


@pytest.mark.parametrize("W,cout,upsample,limit", [(8, 64, 1, "W=8"), (32, 3, 1, "64->3"),
                                                   (32, 64, 2, "upsample fold")])
def test_small_tile_refuses_what_it_does_not_cover(W, cout, upsample, limit, tile_launches):
    gen = torch.Generator(device="cuda").manual_seed(W + cout)
    x, w, b, _ = _make(1, 8, W, True, False, gen, cout)
    assert limit in gluon_conv_tile.spec_unsupported_reason(_spec(x.shape, cout, upsample))
    with pytest.raises(ValueError, match=limit):
        _run(gluon_conv_tile, x, w, b, None, False, upsample)
    assert not tile_launches


def _assert_replay_on_new_input_is_eager(run, x, gen):
    """run() (launches reading x) compiled, captured in a CUDA graph, x refilled, the graph replayed: its output must
    be bitwise what run() gives eagerly on the new x. Three runs of run() in all."""
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    expected = run()
    assert not y.isnan().any() and torch.equal(y, expected)


def _assert_two_convs_replay_on_new_input_is_eager(module, H, W, seed):
    """Two convs of `module` captured back to back (the second reads the first one's output) on a 1 x H x W image."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w, b, r = _make(1, H, W, True, True, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    run = lambda: _run(module, _run(module, x, w, b, None, True), w2, b, r, True)  # noqa: E731
    _assert_replay_on_new_input_is_eager(run, x, gen)


def test_small_tile_graph_replays_new_inputs(tile_launches):
    """Two convs captured back to back with programmatic dependent launch, as in a decode: the replay on new inputs
    must equal the same two launches run eagerly (the second conv sees the first one's fresh output)."""
    _assert_two_convs_replay_on_new_input_is_eager(gluon_conv_tile, 32, 32, seed=6)
    assert len(tile_launches) == 6


# --------------------------------------------------------------------------- the upsample fold's latency kernel


@pytest.mark.parametrize("bias,relu", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("B,H,W,rows", [(1, 32, 32, 1), (1, 100, 64, 2), (1, 126, 100, 4)])
def test_upsample_kernel_epilogues_and_row_counts(bias, relu, B, H, W, rows, up_launches):
    """Each rows-per-program choice (1, 2, 4 low-res rows), a partial last tile (126 = 31 x 4 + 2 rows), a partial
    strip (100 = 64 + 36 columns) and a half-empty one (32 columns: zero fill and clipped stores)."""
    assert gluon_conv_up.rows_per_program(B, H, W, 132) == rows
    _check(gluon_conv_up, B, H, W, bias, False, relu, seed=1000 * rows + int(bias) + 2 * relu, launches=up_launches,
           upsample=2)


@pytest.mark.parametrize("B,H,W", [(2, 30, 40), (1, 64, 64), (1, 128, 128), (3, 5, 17), (1, 1, 64)])
def test_upsample_kernel_shapes(B, H, W, up_launches):
    """The decoder's 64^2 -> 128^2 and 128^2 -> 256^2 upsample convs at B=1, batches, a one-row image."""
    _check(gluon_conv_up, B, H, W, False, False, False, seed=B * 1000 + H * 10 + W, launches=up_launches, upsample=2)


@pytest.mark.parametrize("B,H,W,residual,limit", [(1, 16, 16, True, "plain upsample fold"),
                                                  (1, 256, 256, False, "more than one program per SM"),
                                                  (16, 32, 32, False, "more than one program per SM"),
                                                  (1, 16, 8, False, "W=8")])
def test_upsample_kernel_refuses_what_it_does_not_cover(B, H, W, residual, limit, up_launches):
    """A residual, more than one wave of programs (512^2 and B=16 outputs) and narrow images."""
    gen = torch.Generator(device="cuda").manual_seed(B + H + W)
    x, w, b, _ = _make(B, H, W, True, False, gen)
    r = torch.randn(B, 64, 2 * H, 2 * W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    assert limit in gluon_conv_up.spec_unsupported_reason(_spec(x.shape, 64, 2, residual))
    with pytest.raises(ValueError, match=limit):
        _run(gluon_conv_up, x, w, b, r if residual else None, True, 2)
    assert not up_launches


def test_upsample_kernel_graph_replays_new_inputs(up_launches, tile_launches):
    """The decoder's order, captured with programmatic dependent launch: the upsample conv, then a Block conv that
    reads its output. The replay on new inputs must equal the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, w, b, _ = _make(1, 64, 64, True, False, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    run = lambda: _run(gluon_conv_tile, _run(gluon_conv_up, x, w, None, None, False, 2), w2, b, None, True)  # noqa: E731
    _assert_replay_on_new_input_is_eager(run, x, gen)
    assert len(up_launches) == 3 and len(tile_launches) == 3


# --------------------------------------------------------------------------- the narrow-output latency kernel


@pytest.mark.parametrize("bias,relu", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("B,H,W,cout,rows", [(1, 256, 256, 3, 2), (1, 128, 128, 3, 1), (1, 300, 64, 3, 4),
                                             (1, 300, 256, 3, 4), (2, 9, 200, 7, 1), (1, 255, 40, 1, 2),
                                             (3, 5, 129, 5, 1), (16, 32, 32, 4, 4)])
def test_narrow_kernel(bias, relu, B, H, W, cout, rows, narrow_launches):
    """The decoder's last conv at 256^2 and 128^2 (B=1), the encoder's last (64->4 at 32^2, B=16: 32 of 64 pixels
    per row, 128 four-row programs), each rows-per-program choice (4 with the most shared memory: 6 rows of 256
    pixels), a partial last tile (255 rows in pairs), rows narrower than the tile (40 of 64, 129 and 200 of 256
    pixels: zero fill, masked stores), 1, 4, 5 and 7 output channels (N = 16 and 32)."""
    assert gluon_conv_narrow.rows_per_program(B, H, W, cout, 132) == rows
    _check(gluon_conv_narrow, B, H, W, bias, False, relu, seed=1000 * rows + W + 4 * int(bias) + 2 * relu,
           launches=narrow_launches, cout=cout)


@pytest.mark.parametrize("B,H,W,cout,residual,limit", [(1, 16, 300, 3, False, "W=300"),
                                                       (16, 64, 64, 3, False, "more than one program per SM"),
                                                       (1, 16, 64, 3, True, "a residual"),
                                                       (1, 16, 64, 8, False, "64->8")])
def test_narrow_kernel_refuses_what_it_does_not_cover(B, H, W, cout, residual, limit, narrow_launches):
    """Rows wider than 256, more than one wave of programs, a residual and 8 output channels."""
    gen = torch.Generator(device="cuda").manual_seed(B + H + W + cout)
    x, w, b, r = _make(B, H, W, True, residual, gen, cout)
    assert limit in gluon_conv_narrow.spec_unsupported_reason(_spec(x.shape, cout, residual=residual))
    with pytest.raises(ValueError, match=limit):
        _run(gluon_conv_narrow, x, w, b, r, False)
    assert not narrow_launches


def test_narrow_kernel_graph_replays_new_inputs(tile_launches, narrow_launches):
    """The decoder's end, captured with programmatic dependent launch: a Block conv, then the 64->3 conv reading its
    output. The replay on new inputs must equal the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    x, w, b, r = _make(1, 64, 64, True, True, gen)
    w3 = (torch.randn(3, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b3 = torch.randn(3, generator=gen, device="cuda").half()
    run = lambda: _run(gluon_conv_narrow, _run(gluon_conv_tile, x, w, b, r, True), w3, b3, None, False)  # noqa: E731
    _assert_replay_on_new_input_is_eager(run, x, gen)
    assert len(tile_launches) == 3 and len(narrow_launches) == 3


def test_launch_after_packing_its_weight_goes_without_pdl(monkeypatch):
    """The Gluon convs load their weights before griddepcontrol.wait, so the call whose packing kernel just wrote
    them must launch without programmatic dependent launch; later calls (weight cached) launch with it."""
    seen = []
    real = gluon_conv_narrow.launch
    monkeypatch.setattr(gluon_conv_narrow, "launch", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, _ = _make(1, 16, 64, True, False, gen, 3)
    args = (x, w, b, None, 1, False, 1, False)
    y_first = _run(gluon_conv_narrow, x, w, b, None, False)
    y_cached = _run(gluon_conv_narrow, x, w, b, None, False)
    assert seen[0] == {"PDL": False}, seen[0]
    assert seen[1].get("PDL") is (tma_pdl.PDL and torch.cuda.get_device_capability()[0] >= 9), seen[1]
    assert torch.equal(y_first, y_cached)
    assert_conv_within(y_cached, args)


# --------------------------------------------------------------------------- the CUDA row kernel (cuda_conv_rows)


@pytest.mark.parametrize("B,H,W,rows,bias,residual,relu", [
    (1, 256, 256, None, True, True, True),  # the decoder's 256^2 Block conv at B=1: 4-row runs, 128 programs
    (1, 128, 128, None, True, False, True),  # 1-row runs
    (2, 37, 77, 4, True, True, False),  # a partial strip (77 of 128 columns) and a partial last run
    (3, 5, 300, 2, False, True, True),  # three strips, the last partial; a run past the image's last row
    (1, 9, 130, 3, False, False, False),  # 2 columns in the second strip
    (1, 512, 512, None, True, False, True)])  # 16-row runs: slower than the Gluon kernel there, but correct
def test_row_kernel_matches_the_gluon_kernel(B, H, W, rows, bias, residual, relu, row_launches, launches,
                                             monkeypatch):
    """The CUDA row kernel: within the bound with NaN-poisoned outputs, and bitwise equal to the Gluon row kernel
    on the same runs (the same products in the same order)."""
    if rows is not None:
        monkeypatch.setattr(cuda_conv_rows, "rows_per_program", lambda *a: rows)
        monkeypatch.setattr(gluon_conv_rows, "rows_per_program", lambda *a: rows)
    gen = torch.Generator(device="cuda").manual_seed(B * 100 + H + W)
    x, w, b, r = _make(B, H, W, bias, residual, gen)
    args = (x, w, b, r, 1, relu, 1, False)
    y = _run(cuda_conv_rows, x, w, b, r, relu)
    assert len(row_launches) == 1, "the CUDA row kernel did not run"
    assert_conv_within(y, args)
    y_gluon = _run(gluon_conv_rows, x, w, b, r, relu)  # W > 64: 128-column strips, the same row runs
    assert len(launches) == 1 and torch.equal(y, y_gluon)


def test_row_kernel_graph_replays_new_inputs(row_launches):
    """Captured after a conv that writes its input, with programmatic dependent launch, as in a decode: the replay on
    new inputs equals the same launches run eagerly."""
    _assert_two_convs_replay_on_new_input_is_eager(cuda_conv_rows, 64, 256, seed=9)
    assert len(row_launches) == 6
