"""The value-range warning on CUDA: checked on the first call of each input signature only (a read of the values
waits for the GPU), never inside a CUDA-graph capture."""

import warnings

import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of the check needs a CUDA device")


def test_cuda_checks_each_signature_once():
    model = TAESD.from_pretrained(device="cuda")
    images = torch.rand(1, 3, 64, 64, device="cuda") * 255
    with torch.no_grad():
        with pytest.warns(UserWarning, match="divide by 255"):
            model.encode(images)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.encode(images)  # same signature: not checked again (a graph replay follows)
        with pytest.warns(UserWarning, match="divide by 255"):
            model.encode(torch.rand(2, 3, 64, 64, device="cuda") * 255)  # a new signature is checked


def test_capture_is_not_broken_by_the_check():
    model = TAESD.from_pretrained(device="cuda")
    example = torch.rand(1, 3, 64, 64, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed = CUDAGraphed(model.encode, example)  # warm-up and capture of encode, with its check
        out = graphed(torch.rand(1, 3, 64, 64, device="cuda"))
    assert out.shape == (1, 32, 8, 8) and torch.isfinite(out).all()


def test_the_diffusers_adapter_and_the_model_keep_their_checks_apart():
    """The adapter's [-1, 1] check of a signature must not stand in for the model's own [0, 1] check of it."""
    from taesd_fast import AutoencoderTinyFast

    vae = AutoencoderTinyFast(TAESD.from_pretrained(device="cuda"))
    with torch.no_grad():
        vae.encode(torch.rand(1, 3, 64, 64, device="cuda") * 2 - 1)  # in range for the adapter: no warning
        with pytest.warns(UserWarning, match="divide by 255"):
            vae.taesd.encode(torch.rand(1, 3, 64, 64, device="cuda") * 255)
