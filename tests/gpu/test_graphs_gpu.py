"""CUDAGraphed: a captured TAESD decode replays the eager result for new inputs of the captured shape."""

import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed, kernels_unavailable_reason

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
            with torch.no_grad():
                eager = model.decode(latents)
            # Same algorithms, so equal in practice; 1e-3 allows a different cuDNN pick, while a stale or
            # wrong replay would be off by far more on random latents.
            torch.testing.assert_close(first, eager, rtol=0, atol=1e-3)
            assert not torch.equal(first, second)
    with pytest.raises(ValueError, match=r"captured for \(1, 32, 32, 32\) torch.float16.*got \(2, 32, 32, 32\)"):
        preview(torch.randn(2, 32, 32, 32, device="cuda", dtype=torch.float16))
