"""TAEHV on a CUDA GPU: the dispatched fast path against the float64 reference (within 2x of PyTorch's own fp16
error), the CUDA-graphed streaming step against eager, streaming against parallel, a streaming peak memory that
does not grow with the stream's length, and decode_video and encode_video in chunks: within 2x of PyTorch's fp16
error, their memory beyond the frames bounded by one chunk's. Random weights in the published layout (no TAEHV weights are reachable).
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_taehv import ReferenceTAEHV, published_keys, random_state_dict

from taesd_fast import TAEHV, dispatch
from taesd_fast._backend import kernels_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="TAEHV GPU tests need a CUDA device"),
    pytest.mark.usefixtures("isolated_dispatch"),
]

FAMILIES = {
    "taew2_1": dict(latent=16, patch=1),
    "taew2_2": dict(latent=48, patch=2),
    "taew2_2_super": dict(latent=48, patch=2, super_decoder=True),
    "taehv1_5_super": dict(latent=32, patch=2, super_decoder=True),
    "taeltx_2": dict(latent=128, patch=4, encoder_time=(2, 2, 2), decoder_time=(2, 2, 2)),
}


def _state(name: str) -> dict:
    f = FAMILIES[name]
    return random_state_dict(published_keys(f["latent"], f["patch"], super_decoder=f.get("super_decoder", False),
                                            encoder_time=f.get("encoder_time", (2, 2, 1)),
                                            decoder_time=f.get("decoder_time", (1, 2, 2))), seed=len(name))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    state = _state(request.param)
    return (request.param, state, TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16),
            TAEHV.from_state_dict(state, device="cuda", dtype=torch.float32))


@pytest.mark.parametrize("mode", ["auto", "kernels"])
def test_fast_path_within_2x_of_torch_fp16_error(family, mode, no_tf32):
    if mode == "kernels" and kernels_unavailable_reason() is not None:
        pytest.skip(f"taesd_fast kernels unavailable: {kernels_unavailable_reason()}")
    name, state, m16, m32 = family
    # Small enough for the float64 reference on the CPU; channel widths (the kernels' concern) are the real ones.
    latents = torch.randn(1, 3, m16.latent_channels, 6, 10, generator=torch.Generator().manual_seed(0))
    expected = ReferenceTAEHV(state).decode_video(latents)
    p = m16.patch_size
    video = torch.rand(1, m16.t_downscale + 1, 3, 32 * p, 48 * p, generator=torch.Generator().manual_seed(1))
    expected_latents = ReferenceTAEHV(state).encode_video(video)
    z16, v16 = latents.cuda().half(), video.cuda().half()
    with torch.no_grad():
        with dispatch.backend("torch"):
            torch_frames, torch_latents = m16.decode_video(z16), m16.encode_video(v16)
            fp32_frames = m32.decode_video(latents.cuda())
        with dispatch.backend(mode):
            fast_frames, fast_latents = m16.decode_video(z16), m16.encode_video(v16)
    assert _rel(fp32_frames, expected) < 1e-5  # cuDNN fp32 without TF32 is an fp32 reference
    for what, fast, slow, ref in (("decode", fast_frames, torch_frames, expected),
                                  ("encode", fast_latents, torch_latents, expected_latents)):
        e_fast, e_torch = _rel(fast, ref), _rel(slow, ref)
        print(f"\n{name} {mode} {what}: fast path rel err {e_fast:.3e}, PyTorch fp16 {e_torch:.3e}")
        assert e_fast <= 2 * e_torch + 1e-6, (what, e_fast, e_torch)
    if mode == "kernels":
        print(m16.dispatch_table())


def test_parameters_are_channels_last_on_cuda(family):
    _, _, m16, _ = family
    for name, p in m16.named_parameters():
        if p.dim() == 4 and p.shape[-1] > 1:
            assert p.is_contiguous(memory_format=torch.channels_last), name


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_graphed_step_equals_eager_and_parallel(family, mode):
    name, _, m16, _ = family
    latents = torch.randn(1, 6, m16.latent_channels, 11, 20, device="cuda", dtype=torch.float16)
    with torch.no_grad(), dispatch.backend(mode):
        whole = m16.decode_video(latents)
        m16.cuda_graphs = False
        eager, state = [], None
        for t in range(6):
            out, state = m16.decode_step(latents[:, t], state)
            eager.append(out)
        m16.cuda_graphs = True
        graphed, state = [], None
        for t in range(6):
            out, state = m16.decode_step(latents[:, t], state)
            graphed.append(out)
        assert state._graph is not None, "the stream never replayed a graph"
    # The graph replays the eager kernels on the same shapes: equal up to a different algorithm pick.
    for t, (g, e) in enumerate(zip(graphed, eager)):
        torch.testing.assert_close(g, e, rtol=0, atol=2e-3, msg=f"{name} step {t}")
    torch.testing.assert_close(torch.cat(graphed, 1), whole, rtol=0, atol=2e-3)
    assert graphed[-1].data_ptr() != state._graph.output.data_ptr()  # the caller's frames are their own


@pytest.mark.parametrize("mode", ["auto", "kernels"])
def test_step_within_2x_of_torch_fp16_error(family, mode, no_tf32, monkeypatch):
    """A stream of decode_step calls (graph replays; in a base decoder the one-frame memory blocks' past halves run
    on a side stream) against the float64 reference, within 2x PyTorch fp16's own error; and a step with memory
    skips the memory-block conv in exactly those blocks: 3 per stage that sees one frame of a one-latent step."""
    if mode == "kernels" and kernels_unavailable_reason() is not None:
        pytest.skip(f"taesd_fast kernels unavailable: {kernels_unavailable_reason()}")
    name, state, m16, _ = family
    latents = torch.randn(1, 4, m16.latent_channels, 6, 10, generator=torch.Generator().manual_seed(2))
    expected = ReferenceTAEHV(state).decode_video(latents)
    z16 = latents.cuda().half()
    with torch.no_grad():
        with dispatch.backend("torch"):
            torch_frames = m16.decode_video(z16)
        with dispatch.backend(mode):
            frames, stream = [], None
            for t in range(4):
                out, stream = m16.decode_step(z16[:, t], stream)
                frames.append(out)
            assert stream._graph is not None, "the stream never replayed a graph"
            calls, real = [], dispatch.mem_conv
            monkeypatch.setattr(dispatch, "mem_conv", lambda *a, **k: calls.append(1) or real(*a, **k))
            m16.cuda_graphs = False
            try:
                m16.decode_step(z16[:, 0], stream)
            finally:
                m16.cuda_graphs = True
    e_fast, e_torch = _rel(torch.cat(frames, 1), expected), _rel(torch_frames, expected)
    print(f"\n{name} {mode} step: rel err {e_fast:.3e}, PyTorch fp16 decode_video {e_torch:.3e}")
    assert e_fast <= 2 * e_torch + 1e-6, (e_fast, e_torch)
    f = FAMILIES[name]
    time = f.get("decoder_time", (1, 2, 2))
    single = 3 * sum(math.prod(time[:s]) == 1 for s in range(3))
    assert len(calls) == (0 if f.get("super_decoder") else 9 - single)


def test_graphed_uint8_step(family):
    _, _, m16, _ = family
    latents = torch.randn(1, 4, m16.latent_channels, 11, 20, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        floats = m16.decode_video(latents)
        frames, state = [], None
        for t in range(4):
            out, state = m16.decode_step(latents[:, t], state, uint8=True)
            frames.append(out)
    got = torch.cat(frames, 1)
    assert got.dtype == torch.uint8
    assert (got.float() - floats.float().mul(255)).abs().max() <= 2  # rounding, and fp16 graph vs eager


def test_streaming_peak_memory_does_not_grow():
    model = TAEHV.from_state_dict(_state("taew2_2"), device="cuda", dtype=torch.float16)
    latents = torch.randn(1, 24, 48, 22, 40, device="cuda", dtype=torch.float16)

    def peak(frames: int) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        state = None
        with torch.no_grad():
            for t in range(frames):
                out, state = model.decode_step(latents[:, t], state, uint8=True)
                del out
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak(3)  # warm-up: dispatch timing, graph capture
    short, long = peak(6), peak(24)
    print(f"\nstreaming peak: 6 steps {short / 2**20:.1f} MiB, 24 steps {long / 2**20:.1f} MiB")
    assert long <= short * 1.05 + 2**20


def test_decoding_on_a_second_gpu_keeps_its_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    model = TAEHV.from_state_dict(_state("taew2_1"), device="cuda:1", dtype=torch.float16)
    latents = torch.randn(1, 3, 16, 8, 8, device="cuda:1", dtype=torch.float16)
    state = None
    with torch.no_grad():
        for t in range(3):
            out, state = model.decode_step(latents[:, t], state)
    assert out.device == torch.device("cuda:1")


def test_chunked_decode_within_2x_of_torch_fp16_error(no_tf32):
    """decode_video in chunks of latent frames (chunk_bytes small) against the fp32 whole-video decode: within 2x of
    PyTorch's own fp16 error, for the dispatched path; and chunked fp32 equals whole fp32 to fp32 rounding."""
    state = _state("taew2_2")
    m16 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    m32 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float32)
    latents = torch.randn(1, 7, 48, 11, 20, generator=torch.Generator().manual_seed(4)).cuda()
    per_latent = m32._bytes_per_latent("decoder", 11, 20, next(m32.decoder.parameters()))
    with torch.no_grad():
        m32.chunk_bytes = math.inf
        whole32 = m32.decode_video(latents)
        m32.chunk_bytes = 3 * per_latent  # chunks of 2, 2, 3 latent frames
        assert _rel(m32.decode_video(latents), whole32) < 1e-5
        m16.chunk_bytes = math.inf
        with dispatch.backend("torch"):
            torch_err = _rel(m16.decode_video(latents.half()), whole32)
        m16.chunk_bytes = 3 * per_latent / 2
        outer, inner, _ = m16._decode_chunks(7, 11, 20, next(m16.decoder.parameters()))
        assert inner < 7 * 4  # the full-resolution layers run in several chunks
        chunked = m16.decode_video(latents.half())
        uint8 = m16.decode_video(latents.half(), uint8=True)
    err = _rel(chunked, whole32)
    print(f"\nchunked fp16 rel err {err:.3e}, PyTorch fp16 whole {torch_err:.3e}")
    assert err <= 2 * torch_err + 1e-6
    assert chunked.is_contiguous() and chunked.shape == whole32.shape
    assert (uint8.float() - chunked.float().mul(255)).abs().max() <= 1


def _peak_beyond_result(call, x: torch.Tensor) -> int:
    """Peak GPU memory of call(x) beyond what was allocated before it (x included) and its result, after a warm-up
    call (dispatch timing, cuDNN choices)."""
    with torch.no_grad():
        call(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call(x)
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()


def test_decode_video_memory_beyond_its_output_does_not_grow():
    """chunk_bytes of 4 latent frames' activations at 352x640: beyond its output, a clip and one 3x longer each need
    no more than the budget that sizes the chunks (the bound at any length). Eager calls: a replayed call's bound
    (one chunk plus the graph's copy of the frames) is test_taehv_video_graphs_gpu.py's."""
    model = TAEHV.from_state_dict(_state("taew2_2"), device="cuda", dtype=torch.float16)
    model.cuda_graphs = False
    per_latent = model._bytes_per_latent("decoder", 22, 40, next(model.decoder.parameters()))
    model.chunk_bytes = 4 * per_latent

    def beyond_output(frames: int) -> int:
        return _peak_beyond_result(model.decode_video, torch.randn(1, frames, 48, 22, 40, device="cuda",
                                                                    dtype=torch.float16))

    short, long = beyond_output(8), beyond_output(24)
    print(f"\nbeyond the output: 8 latents {short / 2**20:.0f} MiB, 24 latents {long / 2**20:.0f} MiB, "
          f"chunk budget {4 * per_latent / 2**20:.0f} MiB")
    assert max(short, long) <= 4 * per_latent * 1.25


def test_chunked_encode_within_2x_of_torch_fp16_error(no_tf32):
    """encode_video in both levels of chunks (short chunks of the full-resolution layers gathered into long ones,
    several long ones at the smaller budget) against the fp32 whole-clip encode: within 2x of PyTorch's own fp16
    error for the dispatched path; chunked fp32 equals whole fp32 to fp32 rounding."""
    state = _state("taew2_2")
    m16 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    m32 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float32)
    video = torch.rand(1, 25, 3, 176, 320, generator=torch.Generator().manual_seed(5)).cuda()  # 7 latent frames
    per_latent = m32._bytes_per_latent("encoder", 176, 320, next(m32.encoder.parameters()))
    with torch.no_grad():
        m32.chunk_bytes = math.inf
        whole32 = m32.encode_video(video)
        m16.chunk_bytes = math.inf
        with dispatch.backend("torch"):
            torch_err = _rel(m16.encode_video(video.half()), whole32)
        for budget in (0.2, 2.5):
            m32.chunk_bytes = budget * per_latent
            long, short, _ = m32._encode_chunks(7, 176, 320, next(m32.encoder.parameters()))
            assert short < long and (long < 7 or budget > 1), (budget, long, short)
            assert _rel(m32.encode_video(video), whole32) < 1e-5
            m16.chunk_bytes = budget * per_latent / 2
            err = _rel(m16.encode_video(video.half()), whole32)
            print(f"\nchunks of {long} / {short} latent frames: fp16 rel err {err:.3e}, PyTorch fp16 whole "
                  f"{torch_err:.3e}")
            assert err <= 2 * torch_err + 1e-6


def test_encode_video_memory_beyond_its_input_does_not_grow():
    """chunk_bytes of 2.5 latent frames' activations at 704x1280: beyond its input and latents, a clip and one 3x
    longer each need no more than that budget. Eager calls (the replayed call's bound is the graph tests')."""
    model = TAEHV.from_state_dict(_state("taew2_2"), device="cuda", dtype=torch.float16)
    model.cuda_graphs = False
    per_latent = model._bytes_per_latent("encoder", 704, 1280, next(model.encoder.parameters()))
    model.chunk_bytes = 2.5 * per_latent

    def beyond(latent_frames: int) -> int:
        return _peak_beyond_result(model.encode_video, torch.rand(1, 4 * latent_frames - 3, 3, 704, 1280,
                                                                  device="cuda", dtype=torch.float16))

    short, long = beyond(4), beyond(12)
    print(f"\nencode beyond its input: 4 latents {short / 2**20:.0f} MiB, 12 latents {long / 2**20:.0f} MiB, "
          f"chunk budget {2.5 * per_latent / 2**20:.0f} MiB")
    assert max(short, long) <= 2.5 * per_latent * 1.25


@pytest.mark.parametrize("shape", [(8, 64, 352, 640), (12, 64, 176, 320), (62, 64, 33, 47)])
def test_pooled_frames_within_2x_of_cudnn_fp16(shape, no_tf32):
    """TPool's GEMMs over the unfolded frames (CUDA, channels_last) against float64, on fresh random inputs: within 2x
    of cuDNN's fp16 error on the folded input (the path they replace), worst element and relative."""
    from taesd_fast.models.taehv.layers import TPool, _pooled_frames, frames_to_channels

    gen = torch.Generator().manual_seed(shape[0])
    pool = TPool(shape[1], 2)
    weight = torch.randn(pool.conv.weight.shape, generator=gen) / (2 * shape[1]) ** 0.5
    x = torch.randn(shape, generator=gen).relu()
    expected = torch.nn.functional.conv2d(frames_to_channels(x.double(), 2), weight.double())
    x16 = x.cuda().half().contiguous(memory_format=torch.channels_last)
    w16 = weight.cuda().half()
    got = _pooled_frames(x16, w16, 2)
    cudnn = torch.nn.functional.conv2d(frames_to_channels(x16, 2), w16)
    assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
    worst, cudnn_worst = ((t.double().cpu() - expected).abs().max().item() for t in (got, cudnn))
    print(f"\n{shape}: worst {worst:.3g}, cuDNN fp16 {cudnn_worst:.3g}; rel {_rel(got, expected):.3g}, "
          f"cuDNN {_rel(cudnn, expected):.3g}")
    assert worst <= 2 * cudnn_worst and _rel(got, expected) <= 2 * _rel(cudnn, expected)


@pytest.mark.parametrize("shape", [(31, 128, 88, 160), (62, 64, 176, 320), (5, 64, 33, 47)])
def test_grown_frames_within_2x_of_cudnn_fp16(shape, no_tf32, monkeypatch):
    """TGrow's GEMMs written into each frame's rows (CUDA, channels_last) against float64, on fresh random inputs and
    a NaN-poisoned output: within 2x of cuDNN's fp16 error for the 1x1 conv and unfold they replace, worst element
    and relative."""
    from taesd_fast.models.taehv.layers import TGrow, _grown_frames, channels_to_frames

    gen = torch.Generator().manual_seed(shape[0] + 1)
    grow = TGrow(shape[1], 2)
    weight = torch.randn(grow.conv.weight.shape, generator=gen) / shape[1] ** 0.5
    x = torch.randn(shape, generator=gen).relu()
    expected = channels_to_frames(torch.nn.functional.conv2d(x.double(), weight.double()), 2)
    x16 = x.cuda().half().contiguous(memory_format=torch.channels_last)
    w16 = weight.cuda().half()
    cudnn = channels_to_frames(torch.nn.functional.conv2d(x16, w16), 2)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = _grown_frames(x16, w16, 2)
    monkeypatch.undo()
    assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
    worst, cudnn_worst = ((t.double().cpu() - expected).abs().max().item() for t in (got, cudnn))
    print(f"\n{shape}: worst {worst:.3g}, cuDNN fp16 {cudnn_worst:.3g}; rel {_rel(got, expected):.3g}, "
          f"cuDNN {_rel(cudnn, expected):.3g}")
    assert worst <= 2 * cudnn_worst and _rel(got, expected) <= 2 * _rel(cudnn, expected)
