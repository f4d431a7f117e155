"""TAEHV's TGrow folded into the conv after it (the grow launches of kernels/triton_conv_tma.py and, at 64 -> 64 with
the upsample, kernels/cuda_conv_up.py, used by models/taehv/layers.py `grow_conv`): output frame (i, t) is the conv
of up(x[i]) with the composed weight w . g_t.

Against a float64 TGrow + upsample + conv, on fresh random inputs with NaN-poisoned outputs, three launches per
shape: within 2x the error of the f16 ops the model runs without the fold (TGrow's 1x1 conv, then the conv), in
the relative norm and element by element. Then the model: a taew2_1 stream whose convs run kernels folds TGrow
where the conv after it runs triton_conv_tma, and its frames match the stream without the fold.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_worst_element_within

from taesd_fast.kernels import conv_contract, cuda_conv_up, triton_conv_tma
from taesd_fast.kernels.triton_conv import triton_unavailable_reason

_REASON = "CUDA is not available" if not torch.cuda.is_available() else triton_unavailable_reason("cuda")
if _REASON is None and torch.cuda.get_device_capability()[0] < 9:
    _REASON = "TMA needs compute capability 9.0"
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"TMA conv unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32", "isolated_dispatch"),
]
CL = torch.channels_last

# (B input frames, C, C_out, H, W, grow, upsample, relu): TAEHV's up convs after TGrow (taew2_1 and taew2_2 steps,
# decode chunks), sizes that leave partial tiles, and no upsample with four frames per input frame.
SHAPES = [
    (1, 128, 64, 80, 128, 2, 2, False),
    (2, 64, 64, 160, 256, 2, 2, True),
    (1, 128, 64, 88, 160, 2, 2, False),
    (2, 64, 64, 176, 320, 2, 2, True),
    (1, 256, 128, 40, 64, 1, 2, False),
    (8, 64, 64, 44, 80, 2, 2, True),
    (3, 64, 64, 33, 47, 2, 2, False),
    (2, 32, 64, 9, 13, 4, 1, True),
]


def _grown_then_conv(x, gw, w, b, grow, relu, up):
    B, c, H, W = x.shape
    g = F.conv2d(x, gw).view(B, grow, c, H, W).reshape(B * grow, c, H, W).contiguous(memory_format=CL)
    return conv_contract.conv3x3_math(g, w, b, None, 1, relu, up)


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def _cuda_up_reason() -> str | None:
    from taesd_fast.dispatch import Spec

    return cuda_conv_up.spec_unsupported_reason(Spec("conv2d", "cuda:0", (1, 64, 8, 8), (64, 64, 3, 3), torch.float16,
                                                     1, True, False, True, "channels_last", 2, False))


# (kernel, its grow launch as (x, gw, w, b, grow, relu, upsample) -> y, the shapes it takes)
LAUNCHES = {
    "triton_conv_tma": (triton_conv_tma.grow_launch, lambda s: True),
    "cuda_conv_up": (lambda x, gw, w, b, grow, relu, up: cuda_conv_up.grow_launch(x, gw, w, b, grow, relu),
                     lambda s: s[1:3] == (64, 64) and s[6] == 2),
}


@pytest.mark.parametrize("kernel,shape", [(k, s) for k, (_, takes) in LAUNCHES.items() for s in SHAPES if takes(s)],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[:5])) + f"_g{v[5]}_u{v[6]}")
def test_grow_launch_within_2x_of_torch_fp16(kernel, shape, monkeypatch):
    if kernel == "cuda_conv_up" and _cuda_up_reason() is not None:
        pytest.skip(f"the CUDA upsample conv is unavailable: {_cuda_up_reason()}")
    grow_launch = LAUNCHES[kernel][0]
    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)
    B, c, cout, H, W, grow, up, relu = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    gw = (torch.randn(grow * c, c, 1, 1, generator=gen, device="cuda") / c**0.5).half()
    w = (torch.randn(cout, c, 3, 3, generator=gen, device="cuda") / (3 * c**0.5)).half()
    b = (torch.randn(cout, generator=gen, device="cuda") * 0.5).half()
    first = None
    for launch in range(3):
        x = torch.randn(B, c, H, W, generator=gen, device="cuda").relu().half().contiguous(memory_format=CL)
        y = grow_launch(x, gw, w, b, grow, relu, up)
        ref = _grown_then_conv(x.double(), gw.double(), w.double(), b.double(), grow, relu, up)
        low = _grown_then_conv(x, gw, w, b, grow, relu, up)
        assert y.shape == ref.shape and y.is_contiguous(memory_format=CL)
        assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
        e, e_low = _rel(y, ref), _rel(low, ref)
        assert e <= 2 * e_low, f"launch {launch}: rel err {e:.3g} > 2 x PyTorch f16's {e_low:.3g}"
        assert_worst_element_within(y, low, ref, f"launch {launch}: ")
        if first is None:
            first = (x, y)
    x, y = first
    assert torch.equal(grow_launch(x, gw, w, b, grow, relu, up), y)  # deterministic


def test_grow_launch_rejects_a_wrong_tgrow_weight():
    x = torch.randn(1, 64, 8, 8, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(64, 64, 3, 3, device="cuda").half()
    with pytest.raises(ValueError, match=r"grow_w must be a \(128, 64, 1, 1\) torch.float16 tensor"):
        triton_conv_tma.grow_launch(x, torch.randn(64, 64, 1, 1, device="cuda").half(), w, None, 2, False, 2)


def test_step_folds_tgrow_where_the_conv_runs_the_tma_kernel(monkeypatch):
    """A taew2_1 stream with kernels forced: the steps' convs after TGrow take the grow launch (the 128->64 conv
    after TGrow x2 runs triton_conv_tma), and the frames equal, within f16 steps, the same stream without the fold."""
    from reference_taehv import published_keys, random_state_dict

    from taesd_fast import TAEHV, dispatch
    from taesd_fast.models.taehv import layers

    state = random_state_dict(published_keys(16, 1), seed=5)
    model = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    latents = torch.randn(1, 4, 16, 10, 16, generator=torch.Generator().manual_seed(6)).cuda().half()
    calls, real = [], triton_conv_tma.grow_launch
    monkeypatch.setattr(triton_conv_tma, "grow_launch", lambda *a, **k: calls.append(a[4]) or real(*a, **k))

    def stream():
        frames, s = [], None
        for t in range(latents.shape[1]):
            out, s = model.decode_step(latents[:, t], s)
            frames.append(out)
        return torch.cat(frames, 1)

    with torch.no_grad(), dispatch.backend("kernels"):
        folded = stream()
        assert calls and set(calls) == {2}, calls
        monkeypatch.setattr(layers, "_foldable", lambda *a: False)
        plain = stream()
    torch.testing.assert_close(folded, plain, rtol=0, atol=4e-3)


@pytest.mark.parametrize("kernel", list(LAUNCHES))
def test_a_fold_first_met_inside_a_capture_runs_torch_and_captures_again(kernel, monkeypatch):
    """grow_conv inside a CUDA-graph capture, where the fold has not run for these weights (its weight unpacked;
    packing copies from the host, which a capture forbids): the capture takes PyTorch's TGrow and conv, marks the
    graph to be captured again (dispatch.capture_again), and its replay on new inputs matches them; the next eager
    call runs the fold."""
    if kernel == "cuda_conv_up" and _cuda_up_reason() is not None:
        pytest.skip(f"the CUDA upsample conv is unavailable: {_cuda_up_reason()}")
    from taesd_fast import dispatch
    from taesd_fast.models.layers import conv3x3
    from taesd_fast.models.taehv import layers

    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    grow = layers.TGrow(64, 2).cuda().half()
    conv = conv3x3(64, 64).cuda().half()
    x = torch.randn(1, 64, 24, 40, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    monkeypatch.setattr(dispatch, "conv2d_choice", lambda *a, **k: kernel)
    module = triton_conv_tma if kernel == "triton_conv_tma" else cuda_conv_up
    folds, real = [], module.grow_launch
    monkeypatch.setattr(module, "grow_launch", lambda *a, **k: folds.append(1) or real(*a, **k))
    run = lambda: layers.grow_conv(grow, conv, x, True, 2, True)  # noqa: E731
    with torch.no_grad():
        with dispatch.backend("torch"):
            expected = run()  # also warms up cuBLAS and cuDNN for the capture
        monkeypatch.setattr(dispatch.decide.state, "deferred", False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            y = run()
        torch.cuda.current_stream().wait_stream(stream)
        assert not folds and dispatch.decide.state.deferred
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-3)  # the same PyTorch ops, captured
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
        graph.replay()
        with dispatch.backend("torch"):
            expected = run()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-3)
        folded = run()  # eager: the fold packs and runs
        assert folds == [1]
        torch.testing.assert_close(folded, expected, rtol=2e-3, atol=4e-3)
