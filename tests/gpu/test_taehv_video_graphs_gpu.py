"""TAEHV decode_video / encode_video as whole-call CUDA-graph replays: from the second call of a shape on, the call
is one replay. Each call gets fresh random inputs; each result is checked against an fp32 run (cuDNN without TF32)
within 2x PyTorch fp16's own error, relative and worst element; the graph's output buffer is NaN-poisoned before
a replay, so an element the replay does not write fails; earlier results must survive later calls; memory beyond
the output stays within one chunk's activations plus the graph's copy of the frames. Random weights in the
published layout."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import private_dispatch
from error_bounds import assert_worst_element_within
from reference_taehv import published_keys, random_state_dict

from taesd_fast import TAEHV, dispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="TAEHV graph tests need a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def shared_timings(tmp_path_factory):
    """Blocking tuning whose timings the tests of this file share (one cache folder): each shape is timed once."""
    patch = pytest.MonkeyPatch()
    with private_dispatch(tmp_path_factory.mktemp("timings"), patch):
        yield
    patch.undo()

FAMILIES = {"taew2_2": (48, 2), "taew2_1": (16, 1)}


def _models(name: str):
    latent, patch = FAMILIES[name]
    state = random_state_dict(published_keys(latent, patch), seed=7)
    m16 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    plain16 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    m32 = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float32)
    plain16.cuda_graphs = m32.cuda_graphs = False
    return m16, plain16, m32


def _torch(fn, *args):
    """fn(*args) on PyTorch's own ops (eager: the models it is used with have cuda_graphs off)."""
    with dispatch.backend("torch"):
        return fn(*args)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def _check(out, plain, ref, what):
    e, e_torch = _rel(out, ref), _rel(plain, ref)
    assert e <= 2 * e_torch + 1e-6, f"{what}: rel err {e:.3e} > 2x PyTorch fp16's {e_torch:.3e}"
    assert_worst_element_within(out, plain, ref, what=f"{what}: ")


def _poison_graph(cache) -> None:
    """NaN into the captured graph's output buffer: the next replay must overwrite every element."""
    graph = cache._policy.latest()
    assert graph is not None, "no graph was captured"
    graph._output.fill_(math.nan if graph._output.is_floating_point() else 0)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("uint8", [False, True])
def test_decode_video_replays_its_graph(name, uint8, no_tf32):
    m16, plain16, m32 = _models(name)
    cache = m16._graph_caches["decoder"]
    kept = []
    with torch.no_grad():
        for call in range(4):
            z = torch.randn(1, 5, m16.latent_channels, 11, 20, generator=torch.Generator().manual_seed(call))
            z = z.cuda()
            if call == 3:
                _poison_graph(cache)
            out = m16.decode_video(z.half(), uint8=uint8)
            ref, plain = _torch(m32.decode_video, z), _torch(plain16.decode_video, z.half())
            assert out.shape == ref.shape and out.dtype == (torch.uint8 if uint8 else torch.float16)
            if uint8:
                assert (out.float() - plain.float().clamp(0, 1).mul(255)).abs().max() <= 2, f"call {call}"
            else:
                _check(out, plain, ref, f"{name} call {call}")
            kept.append((out, out.clone()))
            assert len(cache) == (0 if call == 0 else 1), f"call {call}: {len(cache)} graphs"
    for call, (out, copy) in enumerate(kept):
        assert torch.equal(out, copy), f"call {call}'s result was overwritten by a later call"


def test_encode_video_replays_its_graph(no_tf32):
    m16, plain16, m32 = _models("taew2_2")
    cache = m16._graph_caches["encoder"]
    with torch.no_grad():
        for call in range(4):
            video = torch.rand(1, 9, 3, 64, 96, generator=torch.Generator().manual_seed(10 + call)).cuda()
            if call == 3:
                _poison_graph(cache)
            out = m16.encode_video(video.half())
            _check(out, _torch(plain16.encode_video, video.half()), _torch(m32.encode_video, video),
                   f"encode call {call}")
            assert len(cache) == (0 if call == 0 else 1)


def test_new_flags_and_preview_are_new_signatures():
    """uint8, chunking and the preview knobs change what the call computes: each runs eagerly once, then captures."""
    m16, _, _ = _models("taew2_2")
    cache = m16._graph_caches["decoder"]
    z = torch.randn(1, 3, 48, 11, 20, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        m16.decode_video(z), m16.decode_video(z)
        assert len(cache) == 1
        m16.decode_video(z, uint8=True)
        assert len(cache) == 1  # a new signature: eager
        m16.set_preview(space_upscale=(True, True, False))
        eager = m16.decode_video(z)
        assert len(cache) == 1 and eager.shape[-1] == 20 * m16.space_upscale
        replayed = m16.decode_video(z)
        assert len(cache) == 2  # the last 2 are kept
    torch.testing.assert_close(replayed, eager, rtol=0, atol=2e-3)


def test_replayed_decode_memory_is_bounded():
    """Beyond its output, a replayed decode_video holds at most one chunk's activations and the graph's own copy of
    the frames (the capture call included), and the graph is not used when the frames take over half the budget."""
    m16, _, _ = _models("taew2_2")
    per_latent = m16._bytes_per_latent("decoder", 22, 40, next(m16.decoder.parameters()))
    m16.chunk_bytes = 4 * per_latent
    latents = torch.randn(1, 8, 48, 22, 40, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        m16.decode_video(latents)  # eager: decisions, cuDNN choices
        peaks = []
        for _ in range(3):  # the capture, then replays
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = m16.decode_video(latents)
            torch.cuda.synchronize()
            frames = out.numel() * out.element_size()
            peaks.append(torch.cuda.max_memory_allocated() - base - frames)
            del out
    print(f"\nbeyond the output: {[round(p / 2**20) for p in peaks]} MiB; budget {m16.chunk_bytes / 2**20:.0f} MiB, "
          f"frames {frames / 2**20:.0f} MiB")
    assert len(m16._graph_caches["decoder"]) == 1
    assert max(peaks) <= 1.25 * m16.chunk_bytes + frames
    m16.chunk_bytes = 1.9 * frames  # the frames take over half the budget: eager, no graph
    m16._graph_caches["decoder"].clear()
    with torch.no_grad():
        m16.decode_video(latents), m16.decode_video(latents)
    assert len(m16._graph_caches["decoder"]) == 0
