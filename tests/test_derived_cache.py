"""The cache of weight-derived tensors (packed layouts) must never hand back a copy of old values."""

import torch

from taesd_fast.kernels.derived import DerivedCache


def _counting(build):
    calls = []

    def wrapped():
        calls.append(1)
        return build()

    return wrapped, calls


def test_hit_in_place_update_and_data_swap():
    cache = DerivedCache()
    conv = torch.nn.Conv2d(4, 4, 3)
    w = conv.weight
    build, calls = _counting(lambda: w.detach().float() * 2)
    first = cache.get(w, "x2", build)
    assert cache.get(w, "x2", build) is first and len(calls) == 1
    with torch.no_grad():
        w.add_(1.0)  # in place: the version counter moves
    assert torch.equal(cache.get(w, "x2", build), (w.detach() * 2)) and len(calls) == 2
    w.data = torch.randn_like(w)  # same Parameter, same version, new storage
    assert torch.equal(cache.get(w, "x2", build), (w.detach() * 2)) and len(calls) == 3
    conv.double()  # what module.half() / .to() do: .data swapped under the same Parameter
    assert cache.get(w, "x2", build).dtype == torch.float32 and len(calls) == 4


def test_tags_are_separate_and_inference_tensors_rebuild():
    cache = DerivedCache()
    w = torch.randn(3)
    assert torch.equal(cache.get(w, "a", lambda: w + 1), w + 1)
    assert torch.equal(cache.get(w, "b", lambda: w + 2), w + 2)
    with torch.inference_mode():
        v = torch.randn(3)
    build, calls = _counting(lambda: v * 3)
    cache.get(v, "a", build)
    cache.get(v, "a", build)
    assert len(calls) == 2  # no version counter to trust: rebuilt every time


def test_also_tensors_rebuild_the_same_entry():
    """A tensor derived from two (TGrow's weight composed with a conv's): a change to the second rebuilds it, and
    the entry is replaced, not joined by one per version."""
    cache = DerivedCache()
    w, g = torch.randn(3), torch.randn(3)
    build, calls = _counting(lambda: w * g)
    first = cache.get(w, "wg", build, also=(g,))
    assert cache.get(w, "wg", build, also=(g,)) is first and len(calls) == 1
    g.add_(1.0)
    assert torch.equal(cache.get(w, "wg", build, also=(g,)), w * g) and len(calls) == 2
    assert list(cache._d[w]) == ["wg"]
    with torch.inference_mode():
        v = torch.randn(3)
    cache.get(w, "wv", lambda: w * v, also=(v,))
    build, calls = _counting(lambda: w * v)
    cache.get(w, "wv", build, also=(v,))
    assert len(calls) == 1  # an inference tensor among them: rebuilt every time


def test_has_says_whether_get_would_build():
    """has() is True exactly when get() would return the cached tensor (same tag, unchanged src and `also`)."""
    cache = DerivedCache()
    w, g = torch.randn(4), torch.randn(4)
    assert not cache.has(w, "t", also=(g,))
    cache.get(w, "t", lambda: w + g, also=(g,))
    assert cache.has(w, "t", also=(g,)) and not cache.has(w, "other", also=(g,))
    g.add_(1.0)  # a change to an `also` tensor: get would rebuild
    assert not cache.has(w, "t", also=(g,))
    cache.get(w, "t", lambda: w + g, also=(g,))
    w.add_(1.0)
    assert not cache.has(w, "t", also=(g,))
    with torch.inference_mode():
        v = torch.randn(3)
    assert not cache.has(v, "t")  # never cached
