"""The warning for images far outside the encoder's range (taesd_fast.value_range): the likely cause is named, normal
images pass silently, and each call checks at most once."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from taesd_fast import TAESD, AutoencoderTinyFast, encode_tiled
from taesd_fast.value_range import range_hint


@pytest.fixture(scope="module")
def taef2() -> TAESD:
    return TAESD.from_pretrained()


def photo_like(seed: int = 0) -> torch.Tensor:
    """[1, 3, 32, 48] in [0, 1], with dark and bright pixels, like a real photo."""
    return torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("low, high, expected, hint", [
    (0.0, 255.0, (0.0, 1.0), "looks like 0-255 pixel values; divide by 255"),
    (3.0, 180.0, (0.0, 1.0), "looks like 0-255 pixel values; divide by 255"),
    (-1.0, 1.0, (0.0, 1.0), r"looks like \[-1, 1\] images; use \(x \+ 1\) / 2"),
    (-0.98, 0.4, (0.0, 1.0), r"looks like \[-1, 1\] images"),
    (-2.1, 2.6, (0.0, 1.0), r"values far outside \[0, 1\] \(normalised with a mean and std\?\); rescale them"),
    (0.0, 65535.0, (0.0, 1.0), r"values far outside \[0, 1\]"),
    (0.0, 255.0, (-1.0, 1.0), r"looks like 0-255 pixel values; use x / 127\.5 - 1"),
    (-5.0, 5.0, (-1.0, 1.0), r"values far outside \[-1, 1\]"),
])
def test_hint_names_the_likely_cause(low, high, expected, hint):
    message = range_hint(low, high, expected)
    assert message is not None and re.search(hint, message), message


@pytest.mark.parametrize("low, high, expected", [
    (0.0, 1.0, (0.0, 1.0)), (-0.08, 1.07, (0.0, 1.0)), (0.2, 0.6, (0.0, 1.0)), (-0.3, 1.3, (0.0, 1.0)),
    (-1.0, 1.0, (-1.0, 1.0)), (0.0, 1.0, (-1.0, 1.0)), (-1.2, 1.2, (-1.0, 1.0)),
    (float("nan"), float("nan"), (0.0, 1.0)),
])
def test_images_in_range_or_near_it_pass(low, high, expected):
    assert range_hint(low, high, expected) is None


def test_encode_warns_for_0_255_and_minus_one_to_one_images(taef2):
    image = photo_like()
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"images range over \[0\.\d+, 25\d\.?\d*\] but the encoder expects "
                                             r"\[0, 1\]: looks like 0-255 pixel values; divide by 255") as record:
            taef2.encode(image * 255)
        assert record[0].filename == __file__  # points at the caller's line
        with pytest.warns(UserWarning, match=r"looks like \[-1, 1\] images; use \(x \+ 1\) / 2"):
            taef2.encode(image * 2 - 1)
        with pytest.warns(UserWarning, match="divide by 255"):
            encode_tiled(taef2, torch.rand(1, 3, 32, 48) * 255, 512)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            latents = taef2.encode(image)  # [0, 1]: silent
            taef2.decode(latents * 10)  # latents have no range to check
    assert latents.shape == (1, 32, 4, 6)


def test_one_check_per_call_even_when_tiled(taef2, monkeypatch):
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    images = torch.rand(1, 3, 320, 320) * 255
    with torch.no_grad(), pytest.warns(UserWarning) as record:
        taef2.encode(images, tile_size=160)  # 4 tiles
    assert calls == [images.shape]
    assert len([w for w in record if "0-255" in str(w.message)]) == 1


def test_diffusers_adapter_checks_its_own_range(taef2):
    """AutoencoderTinyFast takes [-1, 1] images: 0-255 values get the [-1, 1] advice, once; [-1, 1] passes."""
    vae = AutoencoderTinyFast(taef2)
    image = photo_like(1)
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"expects \[-1, 1\]: looks like 0-255 pixel values; use x / 127\.5 - 1") \
                as record:
            vae.encode(image * 255)
        assert len(record) == 1 and record[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            vae.encode(image * 2 - 1)
            vae.enable_tiling(tile_size=160)
            vae.encode(torch.rand(1, 3, 320, 160) * 2 - 1)


def test_no_check_while_compiling(taef2, monkeypatch):
    """Inside torch.compile a read of the values would break the graph: the check is skipped."""
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: calls.append(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        taef2.encode(photo_like() * 255)
    assert calls == []


@pytest.fixture(scope="module")
def taehv():
    from reference_taehv import published_keys, random_state_dict

    from taesd_fast import TAEHV

    return TAEHV.from_state_dict(random_state_dict(published_keys(16, 1), seed=4))


def test_video_encode_warns_like_image_encode(taehv):
    """TAEHV.encode_video returned garbage for 0-255 or [-1, 1] frames without a word; it now warns as TAESD does,
    from the streaming step too, and stays silent for [0, 1] frames and for decoding."""
    video = torch.rand(1, 4, 3, 16, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"video frames range over \[0\.\d+, 25\d\.?\d*\] but the encoder "
                                             r"expects \[0, 1\]: looks like 0-255 pixel values; divide by 255") as record:
            taehv.encode_video(video * 255)
        assert len(record) == 1 and record[0].filename == __file__
        with pytest.warns(UserWarning, match=r"looks like \[-1, 1\] images; use \(x \+ 1\) / 2") as record:
            taehv.encode_step(video * 2 - 1)
        assert record[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            latents = taehv.encode_video(video)
            taehv.decode_video(latents * 10)
    assert latents.shape == (1, 1, 16, 2, 3)


def test_video_is_checked_once_per_call(taehv, monkeypatch):
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    video = torch.rand(1, 8, 3, 16, 16) * 255
    with torch.no_grad(), pytest.warns(UserWarning):
        taehv.encode_video(video)
    assert calls == [video.shape]
