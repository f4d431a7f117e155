"""TAEHV loading (files by key, folders, the Hub cache), variant detection, bad-input errors, and the streaming
step's CUDA-graph bookkeeping (driven on the CPU with a stand-in for the capture)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import populate_hub_cache
from reference_taehv import published_keys, random_state_dict
from safetensors.torch import save_file

from taesd_fast import TAEHV
from taesd_fast.models.taehv import model as taehv_module
from taesd_fast.models.taehv import stream as taehv_stream
from taesd_fast.models.weights_io import WeightsError

HW = (2, 3)


@pytest.fixture(scope="module")
def w22_state():
    """Random taew2_2 weights (48 channels, patch 2) in the published layout."""
    return random_state_dict(published_keys(48, 2), seed=5)


@pytest.fixture(scope="module")
def w22(w22_state):
    return TAEHV.from_state_dict(w22_state)


def _save(state, path):
    if str(path).endswith(".safetensors"):
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_files_load_by_key(tmp_path, w22_state, suffix):
    path = _save(w22_state, tmp_path / f"model{suffix}")
    model = TAEHV.from_pretrained(path)
    assert model.variant == "taew2_2" and model.latent_channels == 48 and model.patch_size == 2
    loaded = model.state_dict()
    assert set(loaded) == set(w22_state)
    assert all(torch.equal(loaded[k], w22_state[k]) for k in w22_state)


def test_dtype_device_and_parts(tmp_path, w22_state):
    path = _save(w22_state, tmp_path / "taew2_2.safetensors")
    model = TAEHV.from_pretrained(path, dtype="bfloat16", decoder=False)
    assert model.decoder is None and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(RuntimeError, match="without its decoder, so it cannot decode"):
        model.decode_video(torch.randn(1, 1, 48, *HW, dtype=torch.bfloat16))
    decoder_only = {k: v for k, v in w22_state.items() if k.startswith("decoder.")}
    model = TAEHV.from_pretrained(_save(decoder_only, tmp_path / "dec.safetensors"))
    assert model.encoder is None and model.variant == "taew2_2"


def test_identical_tensor_variants_named_by_request_or_file(tmp_path):
    state = random_state_dict(published_keys(16, 1), seed=1)
    assert TAEHV.from_state_dict(state).variant == "taehv"
    assert TAEHV.from_pretrained(_save(state, tmp_path / "taew2_1.safetensors")).variant == "taew2_1"
    assert TAEHV.from_pretrained(_save(state, tmp_path / "x.pth"), variant="taecvx").variant == "taecvx"


def test_taecvx_keeps_all_frames_for_even_latent_counts(tmp_path):
    state = random_state_dict(published_keys(16, 1), seed=1)
    cvx = TAEHV.from_state_dict(state, variant="taecvx")
    hv = TAEHV.from_state_dict(state)
    even, odd = torch.randn(1, 2, 16, *HW), torch.randn(1, 3, 16, *HW)
    assert cvx.decode_video(even).shape[1] == 8 and hv.decode_video(even).shape[1] == 5
    assert cvx.decode_video(odd).shape[1] == hv.decode_video(odd).shape[1] == 9
    torch.testing.assert_close(cvx.decode_video(even)[:, 3:], hv.decode_video(even))


def test_variant_name_that_disagrees_with_tensors(w22_state):
    with pytest.raises(WeightsError, match=r"variant 'taew2_1' \(16 latent channels.*disagrees.*48 latent channels"):
        TAEHV.from_state_dict(w22_state, variant="taew2_1")
    with pytest.raises(ValueError, match="unknown TAEHV variant 'taew3'"):
        TAEHV.from_state_dict(w22_state, variant="taew3")


def test_super_detected_and_not_confused_with_base():
    state = random_state_dict(published_keys(32, 2, super_decoder=True, encoder=False), seed=2)
    model = TAEHV.from_state_dict(state)
    assert model.variant == "taehv1_5_super" and model.arch.super_decoder and model.encoder is None
    with pytest.raises(WeightsError, match="disagrees"):
        TAEHV.from_state_dict(state, variant="taehv1_5")


def test_files_that_do_not_fit(w22_state):
    broken = dict(w22_state)
    del broken["decoder.4.conv.2.bias"]
    with pytest.raises(WeightsError, match=r"1 missing keys \(e.g. decoder.4.conv.2.bias\)"):
        TAEHV.from_state_dict(broken)
    with pytest.raises(WeightsError, match="unexpected key 'model.0.weight'"):
        TAEHV.from_state_dict({"model.0.weight": torch.zeros(1)})
    h3 = random_state_dict(published_keys(24, 2, decoder=False), seed=3)
    with pytest.raises(WeightsError, match="taeh3"):
        TAEHV.from_state_dict(h3)
    mixed = {**random_state_dict(published_keys(16, 1, decoder=False)),
             **{k: v for k, v in w22_state.items() if k.startswith("decoder.")}}
    with pytest.raises(WeightsError, match="encoder .*16 latent channels.* and decoder .*48.* do not belong together"):
        TAEHV.from_state_dict(mixed)


def test_folder_and_hub_cache(tmp_path, w22_state, hub_offline, no_network):
    source = _save(w22_state, tmp_path / "src.safetensors")
    folder = tmp_path / "folder"
    (folder / "safetensors").mkdir(parents=True)
    _save(w22_state, folder / "safetensors" / "taew2_2.safetensors")
    assert TAEHV.from_pretrained(folder).variant == "taew2_2"
    with pytest.raises(FileNotFoundError, match="no TAEHV weights in"):
        TAEHV.from_pretrained(folder, variant="taew2_1")
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "madebyollin/taehv", {"safetensors/taew2_2.safetensors": source})
    for model in (TAEHV.from_pretrained("taew2_2", cache_dir=cache),
                  TAEHV.from_pretrained(variant="taew2_2", cache_dir=cache),
                  TAEHV.from_pretrained("madebyollin/taehv", variant="taew2_2", cache_dir=cache)):
        assert model.variant == "taew2_2"
        assert torch.equal(model.state_dict()["decoder.1.weight"], w22_state["decoder.1.weight"])
    with pytest.raises(FileNotFoundError, match=r"no taew2_1 weights .* local huggingface_hub cache \(offline\); tried "
                                                r"taew2_1.safetensors, safetensors/taew2_1.safetensors, taew2_1.pth"):
        TAEHV.from_pretrained("taew2_1", cache_dir=cache)
    with pytest.raises(ValueError, match="needs a variant name"):
        TAEHV.from_pretrained()


def test_hub_download_asks_for_the_variant_file(monkeypatch, tmp_path, w22_state, hub_reachable):
    """Online: the variant picks the file; the first published name present is used."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    path = _save(w22_state, tmp_path / "blob.safetensors")
    asked = []

    def fake_download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename, kwargs.get("revision")))
        if filename != "taew2_2.pth":
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    model = TAEHV.from_pretrained("taew2_2", revision="abc")
    assert model.variant == "taew2_2"
    assert asked == [("madebyollin/taehv", f, "abc") for f in
                     ("taew2_2.safetensors", "safetensors/taew2_2.safetensors", "taew2_2.pth")]


# ------------------------------------------------------------------------------------------------ bad input


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_bad_inputs_get_one_line_errors(w22):
    good = torch.randn(1, 2, 48, *HW)
    with pytest.raises(ValueError, match=r"must have 48 channels at dim 2") as e:
        w22.decode_video(torch.randn(1, 2, 16, *HW))
    _one_line(e)
    with pytest.raises(ValueError, match=r"has 0 frames") as e:
        w22.decode_video(torch.randn(1, 0, 48, *HW))
    _one_line(e)
    with pytest.raises(ValueError, match=r"looks NCTHW \(channels at dim 1\).*transpose\(1, 2\)") as e:
        w22.decode_video(good.transpose(1, 2))
    _one_line(e)
    with pytest.raises(ValueError, match=r"video .* looks NCTHW") as e:
        w22.encode_video(torch.rand(1, 3, 4, 32, 32))
    _one_line(e)
    with pytest.raises(ValueError, match=r"multiples of 16") as e:
        w22.encode_video(torch.rand(1, 4, 3, 24, 32))
    _one_line(e)
    with pytest.raises(ValueError, match=r"multiple of 4 frames") as e:
        w22.encode_step(torch.rand(1, 3, 3, 32, 32))
    _one_line(e)
    with pytest.raises(TypeError, match=r"dtype torch.float16 but the model is torch.float32") as e:
        w22.decode_video(good.half())
    _one_line(e)
    _, state = w22.decode_step(good[:, 0])
    with pytest.raises(ValueError, match=r"made for batch 1 at 2x3 .* input is batch 2 at 2x3.*state=None") as e:
        w22.decode_step(torch.randn(2, 48, *HW), state)
    _one_line(e)
    with pytest.raises(ValueError, match=r"made for batch 1 at 2x3 .* input is batch 1 at 4x4") as e:
        w22.decode_step(torch.randn(1, 48, 4, 4), state)
    _one_line(e)
    with pytest.raises(TypeError, match=r"state must be what the last decode_step returned") as e:
        w22.decode_step(good[:, 0], {"memory": []})
    _one_line(e)
    _, enc_state = w22.encode_step(torch.rand(1, 4, 3, 32, 32))
    with pytest.raises(TypeError, match=r"for the encoder"):
        w22.decode_step(good[:, 0], enc_state)
    with pytest.raises(ValueError, match="time_upscale\\[0\\]=True.*no time upscale"):
        w22.set_preview(time_upscale=(True, True, True))


def test_state_memory_stays_bounded(w22):
    """The state holds one frame per memory block, whatever the stream's length."""
    state = None
    sizes = []
    for t in range(4):
        _, state = w22.decode_step(torch.randn(1, 48, *HW), state)
        sizes.append(sum(m.numel() for m in state.memory))
    assert len(set(sizes)) == 1 and state.steps == 4
    assert len(state.memory) == 9 and all(m.shape[0] == 1 for m in state.memory)


def test_inference_mode_then_normal_mode(w22):
    """A stream started under inference_mode can continue outside it (the memory is a normal tensor)."""
    with torch.inference_mode():
        _, state = w22.decode_step(torch.randn(1, 48, *HW))
    w22.decode_step(torch.randn(1, 48, *HW), state)


# ------------------------------------------------------------------------------------------------ graph bookkeeping
# CI has no GPU. A stand-in for graphs.capture runs the function as a capture would be prepared (two warm-up runs,
# which change the state's memory), and "replays" by running it again on the same static buffers, as a real replay
# does. The step must come out equal to eager streaming: the memory the warm-ups changed must be put back.


def test_graph_replay_logic_equals_eager_streaming(w22, monkeypatch):
    """Steps 1: eager, 2: captured, then replays; when tuning changes decisions (the dispatch generation moves) the
    next step captures again. The stream equals decode_video throughout."""
    from taesd_fast import dispatch

    captures = []

    def fake_capture(fn):
        fn(), fn()  # warm-up runs on the side stream
        output = fn()  # stands in for the captured run (a real capture records it without running it)
        captures.append(output.shape)
        return (lambda: output.copy_(fn())), output

    _fake_cuda_steps(monkeypatch, fake_capture)
    latents = torch.randn(1, 8, 48, *HW)
    whole = w22.decode_video(latents)
    frames, state = [], None
    for t in range(8):
        if t == 4:
            monkeypatch.setattr(dispatch.decide.state, "generation", dispatch.generation() + 1)
        out, state = w22.decode_step(latents[:, t], state)
        frames.append(out)
        if t == 3:
            assert len(captures) == 1  # the second step captured; the third and fourth replayed
    assert len(captures) == 2  # step 5 captured again, the rest replayed
    assert state._graph.generation == dispatch.generation()
    torch.testing.assert_close(torch.cat(frames, 1), whole, rtol=0, atol=1e-6)
    # A replay returns a fresh tensor: the next replay must not overwrite what the caller holds.
    assert frames[-1].data_ptr() != state._graph.output.data_ptr()


def test_a_failed_step_capture_warns_once_and_the_stream_stays_eager(w22, monkeypatch):
    """A capture that fails after its warm-up ran (and changed the state's memory) puts the memory back: the
    stream still equals decode_video. It warns once; later steps run eagerly with no second attempt."""
    attempts = []

    def failing_capture(fn):
        fn(), fn()  # the warm-up changes the memory before the capture fails
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    _fake_cuda_steps(monkeypatch, failing_capture)
    latents = torch.randn(1, 5, 48, *HW)
    frames, state = [], None
    with pytest.warns(RuntimeWarning, match=r"capture of a TAEHV step failed for input \(1, 48, 2, 3\) "
                                             r"\(RuntimeError: .*\); this stream's steps stay eager") as record:
        for t in range(5):
            out, state = w22.decode_step(latents[:, t], state)
            frames.append(out)
    assert len(record) == 1 and attempts == [1] and state._graph is None
    torch.testing.assert_close(torch.cat(frames, 1), w22.decode_video(latents), rtol=0, atol=1e-6)


def _fake_cuda_steps(monkeypatch, capture) -> None:
    """Streaming steps on CPU take the CUDA-graph path, with `capture` standing in for graphs.capture."""
    monkeypatch.setattr(taehv_module, "replayable", lambda x: True)
    monkeypatch.setattr(taehv_stream.graphs, "capture", capture)
    monkeypatch.setattr(taehv_module.torch.cuda, "device", lambda device: contextlib.nullcontext())
