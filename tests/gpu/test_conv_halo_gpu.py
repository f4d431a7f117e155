"""The Gluon convs, reached through conv_tc's launcher: the row-streaming kernel (kernels/conv_halo.py, halo_w
configs) and the latency kernels for small images (kernels/conv_tile.py, kernels/conv_up.py for the upsample fold
and kernels/conv_narrow.py for 64->3; small_tile configs).

Same bound as test_conv_tc_gpu: rel err vs float64 <= 2x cuDNN's own f16 error on the same inputs, NaN-poisoned
outputs, fresh random inputs. Every case asserts the kernel under test really ran (a fallback to another kernel
would pass the numeric checks too). Row chunks are forced small in some cases so that chunk boundaries (the two
halo rows each chunk re-reads), partial last chunks and several strips per image are all exercised.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from taesd_fast.kernels import conv_halo, conv_narrow, conv_row, conv_tile, conv_up
from taesd_fast.kernels import conv_tc as tc

CL = torch.channels_last

_REASON = "CUDA is not available" if not torch.cuda.is_available() else conv_halo.unsupported_reason(
    torch.empty(1, 64, 1, 64, device="cuda", dtype=torch.float16), 64, 1, 1, False, False)
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"row-streaming conv unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32"),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(tc, "POISON_OUTPUT", True)


def _count_launches(module, monkeypatch) -> list:
    calls = []
    real = module.launch

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(module, "launch", counting)
    return calls


@pytest.fixture
def launches(monkeypatch):
    return _count_launches(conv_halo, monkeypatch)


@pytest.fixture
def row_launches(monkeypatch):
    return _count_launches(conv_row, monkeypatch)


@pytest.fixture
def tile_launches(monkeypatch):
    return _count_launches(conv_tile, monkeypatch)


@pytest.fixture
def up_launches(monkeypatch):
    return _count_launches(conv_up, monkeypatch)


@pytest.fixture
def narrow_launches(monkeypatch):
    return _count_launches(conv_narrow, monkeypatch)


def _make(B, H, W, bias, residual, gen, cout=64):
    x = torch.randn(B, 64, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w = (torch.randn(cout, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b = (torch.randn(cout, generator=gen, device="cuda") * 0.5).half() if bias else None
    r = torch.randn(B, cout, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL) if residual else None
    return x, w, b, r


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _assert_close(y, args):
    """rel err vs float64 <= 2x that of cuDNN f16 run op by op (what the model runs without our kernels)."""
    ref = tc.conv3x3_math(*args, dtype=torch.float64)
    assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
    err, torch_err = rel_err(y, ref), rel_err(tc.conv3x3_math(*args), ref)
    assert err <= 2 * torch_err + 1e-7, f"rel err {err:.3g} > 2 x cuDNN f16 error {torch_err:.3g}"


HALO = lambda halo_w: tc.TCConfig(128, 4, 3, tile_w=16, halo_w=halo_w)  # noqa: E731  (TMA where it cannot run)
SMALL = tc.TCConfig(64, 4, 3, small_tile=True)  # the latency kernels (conv_tile; conv_up, conv_narrow)


def _check(B, H, W, bias, residual, relu, config, seed, launches, cout=64, upsample=1):
    """One launch with config on fresh inputs: the kernel under test ran (launches) and is within the bound."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w, b, r = _make(B, H, W, bias, residual, gen, cout)
    args = (x, w, b, r, 1, relu, upsample, False)
    y = tc.conv3x3_tc_launch(*args, config=config)
    assert launches, "the kernel under test did not run"
    _assert_close(y, args)


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("halo_w", [64, 128])
def test_epilogues(bias, residual, relu, halo_w, launches):
    _check(2, 21, 150, bias, residual, relu, HALO(halo_w), seed=int(bias) + 2 * residual + 4 * relu, launches=launches)


@pytest.mark.parametrize("B,H,W,rows", [(1, 1, 64, None), (1, 2, 64, None), (3, 37, 77, 5), (2, 64, 128, 7),
                                        (1, 40, 300, 3), (2, 9, 200, 1), (1, 130, 70, None), (5, 16, 64, None)])
@pytest.mark.parametrize("halo_w", [64, 128])
def test_shapes_and_row_chunks(B, H, W, rows, halo_w, launches, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(conv_halo, "_rows_per_program", lambda *a: rows)
    _check(B, H, W, True, True, True, HALO(halo_w), seed=B * 1000 + H * 10 + W, launches=launches)


@pytest.mark.parametrize("cout", [3, 16])
@pytest.mark.parametrize("B,H,W,rows", [(2, 21, 150, None), (1, 40, 300, 3), (3, 9, 64, 2)])
def test_narrow_outputs(cout, B, H, W, rows, launches, monkeypatch):
    """64->3 (the decoder's last conv): N padded to 16, masked stores instead of TMA stores."""
    if rows is not None:
        monkeypatch.setattr(conv_halo, "_rows_per_program", lambda *a: rows)
    _check(B, H, W, True, False, cout == 16, HALO(128), seed=cout + H, launches=launches, cout=cout)


@pytest.mark.parametrize("W,cout,residual", [(32, 64, True), (1, 64, False), (63, 3, False), (100, 3, True)])
def test_falls_back_where_it_does_not_apply(W, cout, residual, launches):
    """Narrow images and 64->3 with a residual take the TMA / pointer kernel, with the same results."""
    gen = torch.Generator(device="cuda").manual_seed(W)
    x, w, b, r = _make(2, 7, W, True, residual, gen, cout)
    args = (x, w, b, r, 1, True, 1, False)
    y = tc.conv3x3_tc_launch(*args, config=HALO(128))
    assert not launches
    _assert_close(y, args)


def test_graph_capture_replays_new_inputs(launches):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, w, b, r = _make(4, 32, 96, True, True, gen)
    cfg = HALO(128)
    tc.conv3x3_tc_launch(x, w, b, r, 1, True, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tc.conv3x3_tc_launch(x, w, b, r, 1, True, config=cfg)
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    graph.replay()
    assert len(launches) == 2
    _assert_close(y, (x, w, b, r, 1, True, 1, False))


# --------------------------------------------------------------------------- the latency kernel (conv_tile)


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("B,H", [(2, 17), (1, 9)])  # all 64 channels per program; half (a small grid)
def test_small_tile_epilogues(bias, residual, relu, B, H, tile_launches):
    # 64-column tiles over 40 columns: zero fill, clipped stores
    _check(B, H, 40, bias, residual, relu, SMALL, seed=100 * H + int(bias) + 2 * residual + 4 * relu,
           launches=tile_launches)


@pytest.mark.parametrize("B,H,W,tile", [(1, 32, 32, (1, 32)), (1, 64, 64, (1, 64)), (1, 128, 128, (2, 64)),
                                        (3, 7, 20, (1, 32)), (2, 9, 16, (1, 32)), (1, 1, 64, (1, 32)),
                                        (1, 33, 97, (1, 64)), (4, 5, 33, (1, 32)), (3, 45, 100, (2, 64))])
def test_small_tile_shapes(B, H, W, tile, tile_launches):
    """Each tile shape (rows x channels per program: 1 x 32, 1 x 64, 2 x 64), a half-filled last tile row
    (3 x 45 x 100), narrow images and partial tiles at the right edge."""
    assert conv_tile.tile_shape(B, H, W, 132) == tile
    _check(B, H, W, True, True, True, SMALL, seed=B * 1000 + H * 10 + W, launches=tile_launches)


@pytest.mark.parametrize("W,cout,upsample", [(8, 64, 1), (32, 3, 1), (32, 64, 2)])
def test_small_tile_falls_back_where_it_does_not_apply(W, cout, upsample, tile_launches):
    gen = torch.Generator(device="cuda").manual_seed(W + cout)
    x, w, b, _ = _make(1, 8, W, True, False, gen, cout)
    args = (x, w, b, None, 1, False, upsample, False)
    y = tc.conv3x3_tc_launch(*args, config=SMALL)
    assert not tile_launches
    _assert_close(y, args)


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


def test_small_tile_graph_replays_new_inputs(tile_launches):
    """Two convs captured back to back with programmatic dependent launch, as in a decode: the replay on new inputs
    must equal the same two launches run eagerly (the second conv sees the first one's fresh output)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    x, w, b, r = _make(1, 32, 32, True, True, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    run = lambda: tc.conv3x3_tc_launch(tc.conv3x3_tc_launch(x, w, b, None, 1, True, config=SMALL), w2, b, r, 1,
                                       True, config=SMALL)
    _assert_replay_on_new_input_is_eager(run, x, gen)
    assert len(tile_launches) == 6


# --------------------------------------------------------------------------- the upsample fold's latency kernel


@pytest.mark.parametrize("bias,relu", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("B,H,W,rows", [(1, 32, 32, 1), (1, 100, 64, 2), (1, 126, 100, 4)])
def test_upsample_kernel_epilogues_and_row_counts(bias, relu, B, H, W, rows, up_launches):
    """Each rows-per-program choice (1, 2, 4 low-res rows), a partial last tile (126 = 31 x 4 + 2 rows), a partial
    strip (100 = 64 + 36 columns) and a half-empty one (32 columns: zero fill and clipped stores)."""
    assert conv_up.rows_per_program(B, H, W, 132) == rows
    _check(B, H, W, bias, False, relu, SMALL, seed=1000 * rows + int(bias) + 2 * relu, launches=up_launches,
           upsample=2)


@pytest.mark.parametrize("B,H,W", [(2, 30, 40), (1, 64, 64), (1, 128, 128), (3, 5, 17), (1, 1, 64)])
def test_upsample_kernel_shapes(B, H, W, up_launches):
    """The decoder's 64^2 -> 128^2 and 128^2 -> 256^2 upsample convs at B=1, batches, a one-row image."""
    _check(B, H, W, False, False, False, SMALL, seed=B * 1000 + H * 10 + W, launches=up_launches, upsample=2)


@pytest.mark.parametrize("B,H,W,residual", [(1, 16, 16, True), (1, 256, 256, False), (16, 32, 32, False),
                                            (1, 16, 8, False)])
def test_upsample_kernel_falls_back_where_it_does_not_apply(B, H, W, residual, up_launches):
    """A residual, more than one wave of programs (512^2 and B=16 outputs) and narrow images take the TMA or
    pointer kernel, with results within the same bound."""
    gen = torch.Generator(device="cuda").manual_seed(B + H + W)
    x, w, b, _ = _make(B, H, W, True, False, gen)
    r = torch.randn(B, 64, 2 * H, 2 * W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    args = (x, w, b, r if residual else None, 1, True, 2, False)
    y = tc.conv3x3_tc_launch(*args, config=SMALL)
    assert not up_launches
    _assert_close(y, args)


def test_upsample_kernel_graph_replays_new_inputs(up_launches, tile_launches):
    """The decoder's order, captured with programmatic dependent launch: the upsample conv, then a Block conv that
    reads its output. The replay on new inputs must equal the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, w, b, _ = _make(1, 64, 64, True, False, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    run = lambda: tc.conv3x3_tc_launch(tc.conv3x3_tc_launch(x, w, None, None, 1, False, 2, config=SMALL), w2, b,
                                       None, 1, True, config=SMALL)
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
    assert conv_narrow.rows_per_program(B, H, W, cout, 132) == rows
    _check(B, H, W, bias, False, relu, SMALL, seed=1000 * rows + W + 4 * int(bias) + 2 * relu,
           launches=narrow_launches, cout=cout)


@pytest.mark.parametrize("B,H,W,cout,residual", [(1, 16, 300, 3, False), (16, 64, 64, 3, False),
                                                 (1, 16, 64, 3, True), (1, 16, 64, 8, False)])
def test_narrow_kernel_falls_back_where_it_does_not_apply(B, H, W, cout, residual, narrow_launches):
    """Rows wider than 256, more than one wave of programs, a residual and 8 output channels take another kernel,
    with results within the same bound."""
    gen = torch.Generator(device="cuda").manual_seed(B + H + W + cout)
    x, w, b, r = _make(B, H, W, True, residual, gen, cout)
    args = (x, w, b, r, 1, False, 1, False)
    y = tc.conv3x3_tc_launch(*args, config=SMALL)
    assert not narrow_launches
    _assert_close(y, args)


def test_narrow_kernel_graph_replays_new_inputs(tile_launches, narrow_launches):
    """The decoder's end, captured with programmatic dependent launch: a Block conv, then the 64->3 conv reading its
    output. The replay on new inputs must equal the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    x, w, b, r = _make(1, 64, 64, True, True, gen)
    w3 = (torch.randn(3, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b3 = torch.randn(3, generator=gen, device="cuda").half()
    run = lambda: tc.conv3x3_tc_launch(tc.conv3x3_tc_launch(x, w, b, r, 1, True, config=SMALL), w3, b3, None, 1,
                                       False, config=SMALL)
    _assert_replay_on_new_input_is_eager(run, x, gen)
    assert len(tile_launches) == 3 and len(narrow_launches) == 3


def test_launch_after_packing_its_weight_goes_without_pdl(monkeypatch):
    """The Gluon convs load their weights before griddepcontrol.wait, so the call whose packing kernel just wrote
    them must launch without programmatic dependent launch; later calls (weight cached) launch with it."""
    seen = []
    real = conv_narrow.launch
    monkeypatch.setattr(conv_narrow, "launch", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, _ = _make(1, 16, 64, True, False, gen, 3)
    args = (x, w, b, None, 1, False, 1, False)
    y_first = tc.conv3x3_tc_launch(*args, config=SMALL)
    y_cached = tc.conv3x3_tc_launch(*args, config=SMALL)
    assert seen[0] == {"PDL": False}, seen[0]
    assert seen[1].get("PDL") is (tc.PDL and torch.cuda.get_device_capability()[0] >= 9), seen[1]
    assert torch.equal(y_first, y_cached)
    _assert_close(y_cached, args)


# --------------------------------------------------------------------------- the CUDA row kernel (conv_row)


@pytest.mark.parametrize("B,H,W,rows,bias,residual,relu", [
    (1, 256, 256, None, True, True, True),  # the decoder's 256^2 Block conv at B=1: 4-row runs, 128 programs
    (1, 128, 128, None, True, False, True),  # 1-row runs
    (2, 37, 77, 4, True, True, False),  # a partial strip (77 of 128 columns) and a partial last run
    (3, 5, 300, 2, False, True, True),  # three strips, the last partial; a run past the image's last row
    (1, 9, 130, 3, False, False, False)])  # 2 columns in the second strip
def test_row_kernel_matches_the_gluon_kernel(B, H, W, rows, bias, residual, relu, row_launches, monkeypatch):
    """conv_halo hands short row runs in one wave to the CUDA kernel (conv_row): within the bound with NaN-poisoned
    outputs, and bitwise equal to the Gluon kernel it replaces (the same products in the same order)."""
    if rows is not None:
        monkeypatch.setattr(conv_halo, "_rows_per_program", lambda *a: rows)
    gen = torch.Generator(device="cuda").manual_seed(B * 100 + H + W)
    x, w, b, r = _make(B, H, W, bias, residual, gen)
    args = (x, w, b, r, 1, relu, 1, False)
    y = tc.conv3x3_tc_launch(*args, config=HALO(128))
    assert len(row_launches) == 1, "the CUDA row kernel did not run"
    _assert_close(y, args)
    monkeypatch.setattr(conv_row, "MAX_ROWS", 0)  # now the Gluon kernel
    y_gluon = tc.conv3x3_tc_launch(*args, config=HALO(128))
    assert len(row_launches) == 1 and torch.equal(y, y_gluon)


def test_row_kernel_leaves_long_runs_to_the_gluon_kernel(launches, row_launches):
    """512^2 B=1 runs 16 rows per program, where the Gluon kernel is faster (conv_row's docstring)."""
    _check(1, 512, 512, True, False, True, HALO(128), seed=512, launches=launches)
    assert not row_launches


def test_row_kernel_graph_replays_new_inputs(row_launches):
    """Captured after a conv that writes its input, with programmatic dependent launch, as in a decode: the replay on
    new inputs equals the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, r = _make(1, 64, 256, True, True, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    run = lambda: tc.conv3x3_tc_launch(tc.conv3x3_tc_launch(x, w, b, None, 1, True, config=HALO(128)), w2, b, r, 1,
                                       True, config=HALO(128))
    _assert_replay_on_new_input_is_eager(run, x, gen)
    assert len(row_launches) == 6
