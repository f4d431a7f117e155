"""float16 on a CPU without native float16 convolution ran a 512² encode in 194 s against 0.84 s in float32, with
no word of why. Models that land on such a CPU in float16 (or bfloat16 without native support) now warn once,
naming the cause and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from reference_taehv import published_keys, random_state_dict

from taesd_fast import TAEHV, TAESD, validation


@pytest.fixture
def slow_half(monkeypatch):
    """A CPU like the user's: only float32 convolutions are fast."""
    monkeypatch.setattr(validation, "cpu_has_fast", lambda dtype: dtype == torch.float32)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught], caught


def test_a_gpu_snippet_on_such_a_cpu_warns_once_with_the_cause_and_the_fix(slow_half):
    model, messages, caught = _caught(lambda: TAESD.from_pretrained(dtype=torch.float16, device="cpu"))
    assert messages == ["TAESD is in float16 on the CPU, and this CPU has no fast float16 convolution in PyTorch "
                        "(oneDNN needs AVX512-FP16 or AMX-FP16), so every call runs about 100x slower than in "
                        "float32; use float32 on the CPU (dtype=torch.float32; in the taesd-fast command, leave out "
                        "--dtype): float16 is for CUDA GPUs"]
    assert caught[0].filename == __file__  # the user's line, not the package's
    assert _caught(lambda: model.half())[1] == []  # once per model and dtype
    assert _caught(lambda: model.float())[1] == []
    assert len(_caught(lambda: model.to(torch.bfloat16))[1]) == 1  # a new dtype is a new warning


def test_taehv_warns_the_same_way(slow_half):
    state = random_state_dict(published_keys(16, 1), seed=1)
    messages = _caught(lambda: TAEHV.from_state_dict(state, dtype=torch.float16))[1]
    assert len(messages) == 1 and messages[0].startswith("TAEHV is in float16 on the CPU")


def test_no_warning_where_half_precision_is_fast_or_not_asked_for(monkeypatch):
    monkeypatch.setattr(validation, "cpu_has_fast", lambda dtype: True)
    assert _caught(lambda: TAESD.from_pretrained(dtype=torch.float16))[1] == []
    monkeypatch.setattr(validation, "cpu_has_fast", lambda dtype: dtype == torch.float32)
    assert _caught(lambda: TAESD.from_pretrained())[1] == []  # float32, the CPU default


def test_the_check_asks_torch_about_this_cpu():
    """Without oneDNN PyTorch has no fast half-precision CPU convolution (measured: 110x slower); float32 is fast."""
    assert validation.cpu_has_fast(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on oneDNN TF32 for Intel GPUs, printed by flags()
        with torch.backends.mkldnn.flags(enabled=False):
            assert not validation.cpu_has_fast(torch.float16)
            assert not validation.cpu_has_fast(torch.bfloat16)
    if torch.backends.mkldnn.is_available():
        assert validation.cpu_has_fast(torch.float16) == torch.ops.mkldnn._is_mkldnn_fp16_supported()


def test_the_cli_prints_it_as_one_warning_line(capsys, tmp_path, slow_half):
    pytest.importorskip("PIL")
    from cli_helpers import run, small_image

    image = small_image(tmp_path / "in.png", 64, 64)
    code, _, err = run(capsys, "encode", image, "-o", tmp_path / "z.safetensors", "--dtype", "float16",
                       "--device", "cpu")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("taesd-fast:")]
    assert len(lines) == 1 and lines[0].startswith("taesd-fast: warning: TAESD is in float16 on the CPU"), err
    assert "leave out --dtype" in lines[0]
