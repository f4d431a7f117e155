"""CUDAGraphed: a captured TAESD decode replays the eager result for new inputs of the captured shape."""

import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed, dispatch, kernels_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
    pytest.mark.usefixtures("isolated_dispatch"),
]


@pytest.mark.parametrize("mode", ["auto", "kernels"])
def test_graphed_decode_equals_eager(mode):
    if mode == "kernels" and kernels_unavailable_reason() is not None:
        pytest.skip(f"taesd_fast kernels unavailable: {kernels_unavailable_reason()}")
    from taesd_fast import backend

    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")  # bundled real TAEF2 weights
    example = torch.randn(1, 32, 32, 32, device="cuda", dtype=torch.float16)
    with backend(mode):
        preview = CUDAGraphed(model.decode, example)
        for _ in range(3):
            latents = torch.randn_like(example)
            first = preview(latents)
            second = preview(torch.randn_like(example))  # the first result must not be overwritten
            with torch.no_grad(), dispatch.graph_timing():  # the decisions the graph was captured with
                eager = model.decode(latents)
            # Same algorithms, so equal in practice; 1e-3 allows a different cuDNN pick, while a stale or
            # wrong replay would be off by far more on random latents.
            torch.testing.assert_close(first, eager, rtol=0, atol=1e-3)
            assert not torch.equal(first, second)
    with pytest.raises(ValueError, match=r"captured for \(1, 32, 32, 32\) torch.float16.*got \(2, 32, 32, 32\)"):
        preview(torch.randn(2, 32, 32, 32, device="cuda", dtype=torch.float16))


def test_capture_times_candidates_as_graph_replays():
    """CUDAGraphed decides its layers from graph-replay timings (every eligible candidate timed), and the replay
    matches an eager call that uses those decisions (the CPU tests check they are kept apart from eager ones)."""
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    example = torch.randn(1, 32, 32, 32, device="cuda", dtype=torch.float16)
    preview = CUDAGraphed(model.decode, example)
    graph_recs = [(k, r) for k, r in dispatch.decide.state.decided.items() if k[1]]
    assert graph_recs, "capture made no graph-timed decisions"
    for _, rec in graph_recs:
        if rec.ms:  # a spec with no kernel candidate is not timed
            assert "graph replays" in rec.why and all(t > 0 for t in rec.ms.values()), rec
    assert "graph replays" in dispatch.dispatch_table(model.decoder)
    latents = torch.randn_like(example)
    with torch.no_grad(), dispatch.graph_timing():
        eager = model.decode(latents)
    torch.testing.assert_close(preview(latents), eager, rtol=0, atol=1e-3)


def test_measure_times_every_candidate_as_replays_and_eager_adds_launch_cost():
    w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16) / 24
    x = torch.randn(1, 64, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    args = (x, w, torch.randn(64, device="cuda", dtype=torch.float16), 1, None, True, 1)
    spec = dispatch.spec.spec_of(dispatch.spec.call_key("conv2d", *args))
    meta = dispatch.spec.args_meta(args)
    rows, _ = dispatch.decide.eligible(spec)
    ms, failed = dispatch.measure.time_candidates(rows, spec, meta, graph=True, reps=3)
    assert not failed and set(ms) == {r.name for r in rows} and all(0 < t < 10 for t in ms.values()), (ms, failed)
    # eager decisions add each call's CPU launch time to its GPU time: never less than the replay alone
    eager, failed = dispatch.measure.time_candidates(rows, spec, meta, graph=False, reps=3)
    assert not failed and set(eager) == set(ms) and all(eager[n] > 0.8 * ms[n] + 0.002 for n in ms), (eager, ms)


def _eager_with_graph_decisions(model, fn, x):
    """fn(x) run eagerly with the decisions a capture makes (same kernels as the replay)."""
    model.cuda_graphs = False
    try:
        with torch.no_grad(), dispatch.graph_timing():
            return fn(x)
    finally:
        model.cuda_graphs = True


def test_taesd_replays_a_graph_from_the_second_call_and_sees_new_weights():
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    cache = model._graph_caches["decoder"]
    z = [torch.randn(1, 32, 32, 40, device="cuda", dtype=torch.float16) for _ in range(3)]
    with torch.no_grad():
        model.decode(z[0])
        assert len(cache) == 0  # a first call runs eagerly
        replays = [model.decode(z[1]), model.decode(z[2])]
    assert len(cache) == 1
    for latents, replay in zip(z[1:], replays):
        torch.testing.assert_close(replay, _eager_with_graph_decisions(model, model.decode, latents), rtol=0, atol=1e-3)
    # New weights loaded in place: the graph holds derived copies of the old ones, so it must not be replayed.
    state = {k: v * 1.05 if k.endswith("weight") else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        first = model.decode(z[1])  # eager (with eager decisions): the signature changed with the weights
        model.cuda_graphs = False
        torch.testing.assert_close(first, model.decode(z[1]), rtol=0, atol=1e-3)
        model.cuda_graphs = True
        after = [model.decode(z[1]), model.decode(z[2])]  # capture, replay
    assert len(cache) == 2
    for latents, y in zip(z[1:], after):
        torch.testing.assert_close(y, _eager_with_graph_decisions(model, model.decode, latents), rtol=0, atol=1e-3)
    assert not torch.allclose(after[0], replays[0], atol=1e-3), "the old weights' graph was replayed"


def test_taesd_encode_replays_and_grad_mode_stays_eager():
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    images = [torch.rand(2, 3, 256, 320, device="cuda", dtype=torch.float16) for _ in range(3)]
    with torch.no_grad():
        ys = [model.encode(im) for im in images]
    assert len(model._graph_caches["encoder"]) == 1
    torch.testing.assert_close(ys[2], _eager_with_graph_decisions(model, model.encode, images[2]), rtol=0, atol=1e-3)
    model.requires_grad_(True)  # training: with grad enabled, autograd must record every call
    other = torch.rand(1, 3, 128, 128, device="cuda", dtype=torch.float16)
    latents = [model.encode(other) for _ in range(3)]
    assert len(model._graph_caches["encoder"]) == 1 and all(z.requires_grad for z in latents)
    model.requires_grad_(False)  # as from_pretrained returns it: grad mode alone does not stop replays
    model.encode(other), model.encode(other)
    assert len(model._graph_caches["encoder"]) == 2


def test_taesd_graphs_under_inference_mode():
    """The lip-sync loop decodes under torch.inference_mode(): captures and replays work there too."""
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    z = [torch.randn(4, 32, 16, 16, device="cuda", dtype=torch.float16) for _ in range(3)]
    with torch.inference_mode():
        ys = [model.decode(latents) for latents in z]
    assert len(model._graph_caches["decoder"]) == 1
    torch.testing.assert_close(ys[2], _eager_with_graph_decisions(model, model.decode, z[2]), rtol=0, atol=1e-3)


def test_captures_leave_no_memory_behind():
    """Repeated captures of a call that runs cuBLAS (TAEHV's TPool and TGrow GEMMs do) hold no memory once their
    graphs are gone: cuBLAS keeps a workspace per stream for the life of the process, so the warm-ups share one
    side stream instead of taking a new one per capture."""
    from taesd_fast import graphs

    a = torch.randn(4, 512, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(4, 256, 512, device="cuda", dtype=torch.float16)

    def held_after(captures: int) -> int:
        for _ in range(captures):
            replay, out = graphs.capture(lambda: torch.bmm(a, b))
            replay()
            del replay, out
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    first = held_after(2)
    assert held_after(6) == first
