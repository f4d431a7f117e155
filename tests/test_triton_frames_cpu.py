"""CPU checks of TAEHV's output-frames pass (kernels/triton_frames.py), run by Triton's interpreter: it writes what
PyTorch's pixel_shuffle + clamp (+ * 255, round, uint8) gives, bit for bit, into a slice of a poisoned buffer,
and nothing outside that slice.

The cases run in one subprocess with TRITON_INTERPRET=1 (set before triton is imported), one JSON line per case.
Inputs are fresh random normals around 0.5 (so the clamp bites at both ends), with values placed on the uint8
rounding ties and a NaN, which torch.clamp keeps.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import interpret_cases, report_cases

# (patch, dtype, uint8, samples, frames per sample, skip, h, w, channels_last input)
CASES = {
    "taew2_2_uint8_skip1": (2, "float16", True, 2, 4, 1, 5, 131, True),
    "taew2_1_float": (1, "float16", False, 1, 4, 0, 6, 37, True),
    "bf16_uint8": (2, "bfloat16", True, 1, 3, 0, 3, 130, True),
    "fp32_uint8_skip3_nchw": (1, "float32", True, 2, 5, 3, 4, 9, False),
    "fp32_float_patch4": (4, "float32", False, 1, 2, 1, 3, 5, True),
}
SENTINEL = 77  # uint8 buffers are poisoned with this (NaN for float buffers)


def _inputs(patch, dtype, samples, frames, h, w, channels_last, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(samples * frames, 3 * patch * patch, h, w, generator=gen) * 0.6 + 0.5
    flat = y.permute(0, 2, 3, 1).reshape(-1)
    flat[-65:-1] = (torch.arange(64) * 2 + 1) / 510  # v * 255 lands on (or next to) x.5: the rounding ties
    flat[-1] = float("nan")  # in the last frame, which no case skips
    y = flat.view(samples * frames, h, w, 3 * patch * patch).permute(0, 3, 1, 2).to(getattr(torch, dtype))
    return y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _reference(y, patch, uint8, samples, skip):
    """PyTorch's ops, independent of the model's code: pixel shuffle, clamp, then * 255, round, uint8."""
    frames = F.pixel_shuffle(y, patch).clamp(0, 1)
    if uint8:
        frames = frames.mul(255).round().to(torch.uint8)
    return frames.view(samples, -1, *frames.shape[1:])[:, skip:]


def _run_case(name: str) -> dict:
    from taesd_fast.kernels.triton_frames import ready, write_frames

    patch, dtype, uint8, samples, frames, skip, h, w, cl = CASES[name]
    y = _inputs(patch, dtype, samples, frames, h, w, cl, seed=len(name) * 17 + patch)
    ref = _reference(y, patch, uint8, samples, skip)
    k = frames - skip
    # `into` is a slice of a longer buffer (as decode_video writes a chunk into its output), poisoned all over.
    big = torch.full((samples, k + 3, 3, h * patch, w * patch), SENTINEL if uint8 else float("nan"),
                     dtype=torch.uint8 if uint8 else y.dtype)
    into = big[:, 2:2 + k]
    before = ready(y, into, patch, skip)
    back = write_frames(y, into, patch, skip)
    outside = torch.cat([big[:, :2], big[:, 2 + k:]], 1)
    untouched = bool((outside == SENTINEL).all()) if uint8 else bool(outside.isnan().all())
    nan_kept = bool(ref.isnan().any()) and torch.equal(ref.isnan(), into.isnan()) if not uint8 else None
    kept = _reference(y, patch, False, samples, skip)  # the frames written, before the uint8 conversion
    ties = int(((kept.float() * 255).to(y.dtype).float() % 1 == 0.5).sum())
    return {"name": name, "equal": torch.equal(into, ref) if uint8 else torch.equal(into.nan_to_num(), ref.nan_to_num()),
            "same_tensor": back is into, "untouched": untouched, "nan_kept": nan_kept, "ties": ties,
            # ready: this exact call was launched (not one with another skip, nor one whose output starts misaligned)
            "ready": [before, ready(y, into, patch, skip), ready(y, into, patch, skip + 1),
                      ready(y, torch.empty(into.numel() + 1, dtype=into.dtype)[1:].view(into.shape), patch, skip)]}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    report_cases(CASES, _run_case)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpret_cases(__file__, expected=CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_frames_equal_pytorch_bit_for_bit(interpreted, name):
    got = interpreted[name]
    assert "error" not in got, got.get("error")
    assert got["equal"] and got["same_tensor"] and got["untouched"], got
    assert got["ready"] == [False, True, False, False], got["ready"]
    if CASES[name][2]:
        assert got["ties"] > 0, "the case must hold rounding ties"
    else:
        assert got["nan_kept"], got


def test_rule_names_what_it_cannot_take(monkeypatch):
    from taesd_fast.kernels import triton_frames

    monkeypatch.setattr(triton_frames, "triton_unavailable_reason", lambda device: None)
    y = torch.zeros(4, 12, 3, 5, dtype=torch.float16)
    into = torch.zeros(1, 4, 3, 6, 10, dtype=torch.uint8)
    assert triton_frames.unsupported_reason(y, into, 2) is None
    assert "not a power of two" in triton_frames.unsupported_reason(torch.zeros(4, 27, 3, 5), into, 3)
    assert "is not [N*k, 3, h, w]" in triton_frames.unsupported_reason(y, into, 1)
    assert "output dtype torch.float32" in triton_frames.unsupported_reason(y, into.float(), 2)
    with pytest.raises(ValueError, match=r"^triton_frames: output \(1, 3, 3, 6, 10\) does not hold input"):
        triton_frames.write_frames(y, into[:, :3], 2)


if __name__ == "__main__" and "--interpret-cases" in sys.argv:
    _child_main()
