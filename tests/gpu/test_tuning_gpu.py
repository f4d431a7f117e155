"""Background tuning on the GPU: the first call of a shape runs PyTorch at once while the tuner times the kernels;
once it is done, the call's CUDA graph is captured again with the tuned kernels; captures made while the tuner
works do not fail."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed, dispatch
from taesd_fast._backend import kernels_unavailable_reason

_REASON = kernels_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"taesd_fast kernels unavailable: {_REASON}"),
    pytest.mark.usefixtures("isolated_dispatch"),
]


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = fn()
    torch.cuda.synchronize()
    return y, time.perf_counter() - t0


def _eager_with_graph_decisions(model, latents):
    """The decode run eagerly with the decisions a capture makes (the kernels the replay runs)."""
    model.cuda_graphs = False
    try:
        with torch.no_grad(), dispatch.graph_timing():
            return model.decode(latents)
    finally:
        model.cuda_graphs = True


def test_background_first_calls_run_pytorch_then_replays_run_tuned_kernels():
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    z = torch.randn(1, 32, 32, 32, device="cuda", dtype=torch.float16)
    with torch.no_grad(), dispatch.backend("torch"):
        reference = model.decode(z)  # also initialises cuDNN: what is left is the dispatcher's own cost
    dispatch.set_tuning("background")
    generation = dispatch.generation()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns: make it fail the test
        first, t_first = _timed(lambda: model.decode(z))
        second, t_second = _timed(lambda: model.decode(z))  # captures a graph, or runs eagerly if the tuner is mid-step
        third, t_third = _timed(lambda: model.decode(z))  # replays it, or captures now
    print(f"\nbackground: calls {t_first:.3f} s, {t_second:.3f} s, {t_third:.4f} s; {dispatch.tuning_status()}")
    assert t_first < 1.0, f"first call took {t_first:.2f} s"
    assert dispatch.tuning_status().pending > 0 or dispatch.generation() > generation
    for y in (first, second, third):  # PyTorch rows throughout (cuDNN may pick another algorithm for the graph)
        torch.testing.assert_close(y, reference, rtol=0, atol=1e-3)
    assert t_second < 1.0 and t_third < 1.0

    tick = time.perf_counter()
    assert dispatch.wait_for_tuning(timeout=300), dispatch.tuning_status()
    status = dispatch.tuning_status()
    print(f"tuning done {time.perf_counter() - tick:.1f} s after the third call: {status}")
    assert status.last_error is None and status.generation > generation
    with torch.no_grad():
        latents = torch.randn_like(z)
        tuned, t_recapture = _timed(lambda: model.decode(latents))  # captured again: the generation moved
        replay, t_replay = _timed(lambda: model.decode(latents))
    print(f"re-capture {t_recapture:.3f} s, replay {t_replay * 1e3:.2f} ms")
    assert t_recapture < 1.0 and len(model._graph_caches["decoder"]) == 1
    kernel_rows = [r for _, r in dispatch.rows_of(model.decoder) if r.choice != "torch"]
    assert kernel_rows and all("graph replays" in r.why for r in kernel_rows), model.dispatch_table()
    expected = _eager_with_graph_decisions(model, latents)
    torch.testing.assert_close(tuned, expected, rtol=0, atol=1e-3)
    torch.testing.assert_close(replay, expected, rtol=0, atol=1e-3)
    # and the tuned decode is as close to a float32 decode as PyTorch's float16 one is (within 2x)
    m32 = TAESD.from_pretrained(dtype=torch.float32, device="cuda")
    with torch.no_grad(), dispatch.backend("torch"):
        ref32 = m32.decode(latents.float()).double()
        torch_err = (model.decode(latents).double() - ref32).norm() / ref32.norm()
    assert (replay.double() - ref32).norm() / ref32.norm() <= 2 * torch_err


def test_captures_while_the_tuner_works_do_not_fail():
    """The tuner holds gpu_lock around its GPU steps and graphs.capture holds it around warm-up and capture: a
    capture made while shapes are being tuned neither fails nor corrupts the replay."""
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    dispatch.set_tuning("background")
    with torch.no_grad():
        for batch in (1, 2, 4):  # queue several shapes: minutes of tuning on a fresh cache
            model.decode(torch.randn(batch, 32, 24, 24, device="cuda", dtype=torch.float16))
    assert dispatch.tuning_status().pending > 0
    captured = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        while dispatch.tuning_status().pending > 0 and captured < 20:
            z = torch.randn(1, 32, 8 + 2 * captured, 8, device="cuda", dtype=torch.float16)
            y = CUDAGraphed(model.decode, z)(z)
            with dispatch.backend("torch"):
                # The replay may run kernels the tuner published meanwhile (f16 rounding apart from cuDNN's); a
                # failed or corrupted capture would be far off on random latents.
                torch.testing.assert_close(y, model.decode(z), rtol=0, atol=1e-2)
            captured += 1
    print(f"\n{captured} captures while tuning; {dispatch.tuning_status()}")
    assert captured > 0
    assert dispatch.wait_for_tuning(timeout=600) and dispatch.tuning_status().last_error is None

