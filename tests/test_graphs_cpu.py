import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed


def test_cuda_graph_needs_a_cuda_example():
    model = TAESD("taesd")
    with pytest.raises(ValueError, match=r"needs an example CUDA tensor"):
        CUDAGraphed(model.decode, torch.randn(1, 4, 8, 8))



# --------------------------------------------------------------------------- GraphCache (TAESD.encode / decode)
# CI has no GPU: these drive the cache's bookkeeping with a stand-in for CUDAGraphed that records its captures
# and replays by calling fn (the GPU tests check real captures).

from taesd_fast import dispatch, graphs  # noqa: E402


class _FakeGraphed:
    captures = []

    def __init__(self, fn, example, wait=True):
        self.fn = fn
        self.replays = 0
        self.generation = dispatch.generation()  # as CUDAGraphed records it
        _FakeGraphed.captures.append(tuple(example.shape))

    def __call__(self, x):
        self.replays += 1
        return self.fn(x)


@pytest.fixture
def fake_graphs(monkeypatch):
    _FakeGraphed.captures = []
    monkeypatch.setattr(graphs, "CUDAGraphed", _FakeGraphed)
    monkeypatch.setattr(graphs, "_replayable", lambda x, params: True)
    return _FakeGraphed.captures


def test_graph_cache_captures_on_the_second_call_of_a_signature(fake_graphs):
    cache, params = graphs.GraphCache(), [torch.nn.Parameter(torch.randn(3))]
    calls = []
    fn = lambda x: calls.append(tuple(x.shape)) or x * 2  # noqa: E731
    x = torch.randn(2, 3)
    assert torch.equal(cache(fn, x, params), 2 * x) and fake_graphs == [] and len(cache) == 0  # first: eager
    assert torch.equal(cache(fn, x, params), 2 * x) and fake_graphs == [(2, 3)] and len(cache) == 1  # second: capture
    cache(fn, torch.randn(2, 3), params)
    assert fake_graphs == [(2, 3)]  # third: replay, no new capture
    cache(fn, torch.randn(4, 3), params)
    assert fake_graphs == [(2, 3)] and len(cache) == 1  # a new shape starts eager again


def test_graph_cache_recaptures_after_weights_change(fake_graphs):
    cache, p = graphs.GraphCache(), torch.nn.Parameter(torch.randn(3))
    fn = lambda x: x + 1  # noqa: E731
    x = torch.randn(2, 3)
    cache(fn, x, [p]), cache(fn, x, [p])
    assert len(fake_graphs) == 1
    with torch.no_grad():
        p.mul_(2)  # in place: same address, new version (what load_state_dict does)
    cache(fn, x, [p])
    assert len(fake_graphs) == 1  # eager: the graph would still hold derived copies of the old weights
    cache(fn, x, [p])
    assert len(fake_graphs) == 2
    p.data = p.data.clone()  # new address (what .to() / .half() do)
    cache(fn, x, [p]), cache(fn, x, [p])
    assert len(fake_graphs) == 3


def test_graph_cache_keeps_the_most_recently_used(fake_graphs):
    cache, params = graphs.GraphCache(max_graphs=2), []
    fn = lambda x: x  # noqa: E731
    shapes = [(1, 2), (2, 2), (3, 2)]
    for shape in shapes:
        cache(fn, torch.randn(shape), params), cache(fn, torch.randn(shape), params)
    assert len(cache) == 2 and fake_graphs == shapes
    cache(fn, torch.randn(3, 2), params)  # a replay: nothing captured or dropped
    assert len(cache) == 2 and fake_graphs == shapes
    cache(fn, torch.randn(1, 2), params)  # (1, 2) was dropped; already seen, so it is captured again at once
    assert fake_graphs == shapes + [(1, 2)] and len(cache) == 2


def test_graph_cache_stays_eager_where_capture_fails(monkeypatch):
    def failing(fn, example, wait=True):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "CUDAGraphed", failing)
    monkeypatch.setattr(graphs, "_replayable", lambda x, params: True)
    cache, x = graphs.GraphCache(), torch.randn(2)
    cache(lambda t: t, x, [])
    with pytest.warns(RuntimeWarning, match=r"capture failed for input \(2,\).*stay eager") as record:
        cache(lambda t: t, x, [])
    assert record[0].filename == __file__  # the warning names the cache's caller
    monkeypatch.setattr(graphs, "CUDAGraphed", lambda *a: pytest.fail("no second capture attempt"))
    assert torch.equal(cache(lambda t: t + 1, x, []), x + 1)


def test_replayable_only_on_cuda():
    p = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    assert not graphs._replayable(torch.randn(2), [p])  # CPU tensors always run eagerly
    assert not graphs._replayable(torch.empty(2, device="meta"), [p])


def test_taesd_uses_its_graph_caches_and_forgets_them_on_moves(fake_graphs):
    model = TAESD("taesd")
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        eager = model.decode(z)
        model.decode(z)
        assert len(model._graph_caches["decoder"]) == 1 and fake_graphs == [(1, 4, 8, 8)]
        assert torch.equal(model.decode(z), eager)  # the replay stand-in runs the same decode
        model.to(torch.float64)  # moves go through _apply: the graphs held the old weights
        assert len(model._graph_caches["decoder"]) == 0
        model.cuda_graphs = False
        model.decode(z.double()), model.decode(z.double())
        assert len(model._graph_caches["decoder"]) == 0 and fake_graphs == [(1, 4, 8, 8)]


def test_graph_cache_extra_flags_are_part_of_the_signature(fake_graphs):
    cache, params = graphs.GraphCache(), [torch.nn.Parameter(torch.randn(3))]
    x = torch.randn(2, 3)
    cache(lambda t: t, x, params, extra=(False,)), cache(lambda t: t, x, params, extra=(True,))
    assert fake_graphs == []  # each flag seen once: eager
    cache(lambda t: t, x, params, extra=(True,))
    assert fake_graphs == [(2, 3)]


def test_taehv_video_calls_use_their_graph_caches_within_the_budget(fake_graphs):
    """decode_video / encode_video go through the whole-call graph caches (the GPU tests check real captures):
    from the second call of a signature on, except with a progress bar or frames over half of chunk_bytes; the
    caches are forgotten on moves."""
    from taesd_fast import TAEHV

    model = TAEHV("taew2_1")
    z = torch.randn(1, 2, 16, 4, 6)
    video = torch.rand(1, 5, 3, 32, 48)
    dec, enc = model._graph_caches["decoder"], model._graph_caches["encoder"]
    with torch.no_grad():
        eager = model.decode_video(z)
        assert torch.equal(model.decode_video(z), eager) and len(dec) == 1
        model.decode_video(z, uint8=True), model.decode_video(z, uint8=True)
        assert len(dec) == 2 and fake_graphs == [(1, 2, 16, 4, 6)] * 2
        model.encode_video(video), model.encode_video(video)
        assert len(enc) == 1
        model.decode_video(z, show_progress_bar=True)
        model.decode_video(z, show_progress_bar=True)
        model.chunk_bytes = 2 * eager.numel() * eager.element_size() - 1  # the frames take over half of it
        model.decode_video(z), model.decode_video(z)
        assert len(fake_graphs) == 3
        model.to(torch.float64)
        assert len(dec) == len(enc) == 0
        model.cuda_graphs = False
        model.decode_video(z.double()), model.decode_video(z.double())
        assert len(dec) == 0 and len(fake_graphs) == 3


def test_wan_adapter_keeps_taehvs_whole_call_graphs_off_unless_asked(fake_graphs):
    """A pipeline decodes once per video: AutoencoderTinyWan holds no whole-call graph between videos by default,
    replays one with cuda_graphs = True, and leaves the wrapped TAEHV's own switch as it was."""
    from taesd_fast import TAEHV
    from taesd_fast.models.taehv.diffusers import AutoencoderTinyWan

    vae = AutoencoderTinyWan(TAEHV("taew2_1"))
    z = torch.randn(1, 16, 2, 4, 6)  # NCTHW
    video = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    with torch.no_grad():
        for _ in range(3):
            vae.decode(z), vae.encode(video)
        assert fake_graphs == [] and vae.taehv.cuda_graphs
        vae.cuda_graphs = True
        for _ in range(2):
            vae.decode(z), vae.encode(video)
    assert len(vae.taehv._graph_caches["decoder"]) == len(vae.taehv._graph_caches["encoder"]) == 1


def test_diffusers_adapter_decode_uses_the_graph_cache(fake_graphs):
    from taesd_fast import AutoencoderTinyFast

    vae = AutoencoderTinyFast(TAESD("taesd"))
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        first = vae.decode(z).sample
        second = vae.decode(z).sample
    assert len(vae.taesd._graph_caches["raw_decoder"]) == 1 and fake_graphs == [(1, 4, 8, 8)]
    assert torch.equal(first, second) and first.min() < 0  # unclamped, in [-1, 1] conventions


def test_pretrained_models_are_inference_models():
    """Without torch.no_grad() a call must still be replayable: from_pretrained turns the weights' gradients off,
    while gradients with respect to the inputs still flow (through the PyTorch path)."""
    model = TAESD.from_pretrained()  # bundled TAEF2
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    latents = torch.randn(1, 32, 4, 4, requires_grad=True)
    model.decode(latents).sum().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0


def test_parameters_of_is_cached_until_a_module_or_parameter_is_registered():
    model = TAESD("taesd", encoder=False)
    parameters_of = graphs.parameters_of
    first = parameters_of(model.decoder)
    assert first == list(model.decoder.parameters())
    assert parameters_of(model.decoder) is first  # no module walk on the next call
    model.half()  # swaps .data, keeps the Parameter objects: the list stays right
    assert parameters_of(model.decoder) is first
    model.decoder[1] = torch.nn.Conv2d(4, 64, 3, padding=1)  # a replaced layer: its new weight must be in the list
    fresh = parameters_of(model.decoder)
    assert fresh is not first and any(p is model.decoder[1].weight for p in fresh)
    model.decoder[1].bias = torch.nn.Parameter(torch.zeros(64))
    assert any(p is model.decoder[1].bias for p in parameters_of(model.decoder))


def test_graph_cache_captures_again_when_the_dispatch_generation_moves(fake_graphs, monkeypatch):
    """A graph bakes in the dispatch decisions of its capture. When tuning replaces them (the generation moves), the
    next call of a signature that has a graph captures again at once; signatures seen once stay eager as before."""
    cache, params = graphs.GraphCache(), []
    fn = lambda x: x * 3  # noqa: E731
    x, y = torch.randn(2, 3), torch.randn(5, 3)
    cache(fn, x, params), cache(fn, x, params)  # eager, capture
    cache(fn, y, params)  # y seen once: eager
    assert fake_graphs == [(2, 3)]
    generation = dispatch.generation()
    monkeypatch.setattr(dispatch.decide.state, "generation", generation + 1)
    assert torch.equal(cache(fn, x, params), 3 * x)
    assert fake_graphs == [(2, 3), (2, 3)] and len(cache) == 1  # captured again, the stale graph dropped
    cache(fn, x, params)
    assert fake_graphs == [(2, 3), (2, 3)]  # the new graph replays
    cache(fn, y, params)  # second call of y: its first capture, as without a generation change
    assert fake_graphs == [(2, 3), (2, 3), (5, 3)]
