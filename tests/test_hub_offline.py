"""Loading by Hub name where the Hub cannot be reached: huggingface_hub alone retried each file for about 25 s before
an error. One short probe per process decides instead; the cache is searched at once, and the message says how to
work offline. The network is refused here (no_network), as on a machine without one."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
from conftest import populate_hub_cache
from reference_taehv import published_keys, random_state_dict
from safetensors.torch import save_file

from taesd_fast import TAEHV, TAESD
from taesd_fast.models import hub_files


@pytest.fixture
def downloads(monkeypatch):
    """Every hf_hub_download call's local_files_only, the real function still doing the work."""
    import huggingface_hub

    real, calls = huggingface_hub.hf_hub_download, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    return calls


@pytest.fixture(scope="module")
def taehv_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("taehv") / "taew2_1.safetensors"
    save_file(random_state_dict(published_keys(16, 1), seed=2), str(path))
    return path


@pytest.mark.parametrize("load", [
    lambda cache: TAEHV.from_pretrained("taew2_2", cache_dir=cache),
    lambda cache: TAESD.from_pretrained("madebyollin/taesdxl", cache_dir=cache),
], ids=["TAEHV", "TAESD"])
def test_an_unreachable_hub_and_an_empty_cache_fail_at_once_in_one_line(load, tmp_path, no_network, downloads):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        load(tmp_path / "empty")
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert elapsed < 2 * hub_files.HUB_PROBE_SECONDS, elapsed
    assert "\n" not in message
    assert "could not reach the Hugging Face Hub" in message and "HF_HUB_OFFLINE=1" in message, message
    assert downloads and all(downloads), downloads  # the cache only: no request left to retry


def test_a_cached_file_loads_with_one_warning_that_says_how_to_work_offline(tmp_path, no_network, downloads,
                                                                             taehv_file):
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "madebyollin/taehv", {"taew2_1.safetensors": taehv_file})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = TAEHV.from_pretrained("taew2_1", cache_dir=cache)
    assert model.variant == "taew2_1" and all(downloads)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "cannot be reached" in messages[0] and "cached copy of madebyollin/taehv" in messages[0]
    assert "HF_HUB_OFFLINE=1" in messages[0] and "\n" not in messages[0]
    assert caught[0].filename == __file__  # it names the caller's line, not the package's


def test_the_probe_runs_once_per_process(monkeypatch, tmp_path):
    from huggingface_hub import utils

    asked = []

    class Unreachable:
        def head(self, url, timeout):
            asked.append((url, timeout))
            raise ConnectionError("network is unreachable")

    monkeypatch.setattr(utils, "get_session", lambda: Unreachable())
    for _ in range(3):
        with pytest.raises(FileNotFoundError, match=r"\(ConnectionError: network is unreachable\)"):
            TAESD.from_pretrained("madebyollin/taesd", cache_dir=tmp_path)
    assert len(asked) == 1 and asked[0][1] == hub_files.HUB_PROBE_SECONDS


def test_a_hub_that_does_not_answer_is_given_up_on_in_time(monkeypatch):
    from huggingface_hub import utils

    release = threading.Event()

    class Silent:
        def head(self, url, timeout):
            release.wait(30)  # a hung DNS lookup or connection: the caller must not wait for it

    monkeypatch.setattr(utils, "get_session", lambda: Silent())
    monkeypatch.setattr(hub_files, "HUB_PROBE_SECONDS", 0.2)
    start = time.perf_counter()
    reason = hub_files.hub_unreachable_reason()
    release.set()
    assert time.perf_counter() - start < 1.0
    assert isinstance(reason, TimeoutError) and "within 0.2 s" in str(reason)


def test_a_hub_that_answers_is_asked_for_the_files(monkeypatch, tmp_path, taehv_file):
    """The probe only decides; when the Hub answers, the download goes ahead as before (not cache-only)."""
    import huggingface_hub
    from huggingface_hub import utils

    class Answers:
        def head(self, url, timeout):
            return object()

    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append(kwargs["local_files_only"])
        return str(taehv_file)

    monkeypatch.setattr(utils, "get_session", lambda: Answers())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert TAEHV.from_pretrained("taew2_1").variant == "taew2_1"
    assert calls == [False]


def test_offline_mode_skips_the_probe(monkeypatch, tmp_path, hub_offline):
    from huggingface_hub import utils

    monkeypatch.setattr(utils, "get_session", lambda: pytest.fail("probed the Hub in offline mode"))
    with pytest.raises(FileNotFoundError, match="offline"):
        TAESD.from_pretrained("madebyollin/taesd", cache_dir=tmp_path)


def test_the_video_command_fails_fast_in_one_line(capsys, tmp_path, no_network):
    pytest.importorskip("av")
    from cli_helpers import assert_user_error, run
    from conftest import TALKING_HEAD_CLIP

    start = time.perf_counter()
    code, _, err = run(capsys, "video", "roundtrip", TALKING_HEAD_CLIP, "-o", tmp_path / "out.mp4",
                       "--variant", "taew2_1", "--max-frames", "1")
    assert time.perf_counter() - start < 2 * hub_files.HUB_PROBE_SECONDS
    assert_user_error(code, err, "could not reach the Hugging Face Hub", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "out.mp4").exists()


def test_the_output_head_uses_the_same_probe(tmp_path, no_network, downloads):
    from taesd_fast import OutputHead

    with pytest.raises(FileNotFoundError, match=r"cannot be reached .*HF_HUB_OFFLINE=1") as info:
        OutputHead.from_pretrained(cache_dir=tmp_path)
    assert "\n" not in str(info.value) and all(downloads)



def test_bare_variant_names_load_as_taehv_names_do(tmp_path, hub_offline):
    """TAESD.from_pretrained("taesd") means madebyollin/taesd, "taef2" the bundled weights, and a variant with no
    repo gets a one-line error saying where its files are (an existing folder of that name is read as a folder)."""
    import torch

    bundled, by_name = TAESD.from_pretrained(), TAESD.from_pretrained("taef2")
    assert by_name.variant == "taef2"
    assert all(torch.equal(a, b) for a, b in zip(bundled.state_dict().values(), by_name.state_dict().values()))
    with pytest.raises(FileNotFoundError) as info:
        TAESD.from_pretrained("taesdxl", cache_dir=tmp_path)
    assert "madebyollin/taesdxl" in str(info.value) and "neither an existing local folder" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"^taesana's weights are on no Hub repo.*variant='taesana'") as info:
        TAESD.from_pretrained("taesana")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="the name is a variant already"):
        TAESD.from_pretrained("taesd", variant="taef1")
