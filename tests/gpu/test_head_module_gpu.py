"""OutputHead on the GPU through dispatch (forced kernels and auto): error budget, chunked equals one-shot.

Tolerance: relative error vs a float64 reference at most 2x PyTorch's own bf16 head (backend "torch").
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import random_output_head
from taesd_fast import OutputHead, _backend, backend
from taesd_fast.kernels import rows as kernel_rows

pytestmark = [
    pytest.mark.skipif(
        _backend.kernels_unavailable_reason() is not None,
        reason=f"taesd_fast kernels unavailable: {_backend.kernels_unavailable_reason()}",
    ),
    pytest.mark.usefixtures("isolated_dispatch"),
]


HEAD_KERNELS = tuple(r.name for r in kernel_rows.KERNEL_ROWS if r.kind == "head_full")  # every head kernel row

def _head(c_in=256, seed=0) -> OutputHead:
    return random_output_head(c_in, seed, gamma_spread=0.1, weight_gain=0.6, patch_size=2)


def _reference(head: OutputHead, features: torch.Tensor) -> torch.Tensor:
    """float64 head on the CPU: norm, SiLU, two zero frames in front, conv3d, clamp, unpatchify."""
    h64 = _head(head.in_channels).double()
    h64.load_state_dict({k: v.double().cpu() for k, v in head.state_dict().items()})
    with torch.no_grad(), backend("torch"):
        return h64(features.double().cpu())[0]


def _rel(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mode", ["kernels", "auto"])
def test_head_chunked_equals_one_shot_and_meets_error_budget(mode):
    head = _head().cuda().bfloat16()
    features = torch.randn(1, 256, 9, 40, 72, device="cuda").bfloat16()
    ref = _reference(head, features)
    with torch.no_grad():
        with backend("torch"):
            torch_err = _rel(head(features)[0], ref)
        with backend(mode):
            one_shot = head(features)[0]
            chunks, cache = [], None
            for start, stop in ((0, 1), (1, 5), (5, 9)):
                out, cache = head(features[:, :, start:stop], cache)
                chunks.append(out)
    chunked = torch.cat(chunks, dim=2)
    assert _rel(one_shot, ref) <= 2 * torch_err
    assert _rel(chunked, ref) <= 2 * torch_err
    # Different T means different GEMM shapes, so rounding may differ by a bf16 step, never more.
    assert (chunked.float() - one_shot.float()).abs().max().item() <= 2**-7
    if mode == "kernels":
        last = head.dispatch_table().splitlines()[-1]
        assert last.split()[7] in HEAD_KERNELS, head.dispatch_table()


def test_auto_picks_a_kernel_for_the_wan_chunk_shape():
    """At the real decode size (T=4 + 2 cached, 352x640) both kernel paths were measured several times faster than
    PyTorch: auto must pick one of them."""
    head = _head().cuda().bfloat16()
    features = torch.randn(1, 256, 4, 352, 640, device="cuda").bfloat16()
    with torch.no_grad(), backend("auto"):
        head(features, F.silu(torch.randn(1, 256, 2, 352, 640, device="cuda")).bfloat16())
    last = head.dispatch_table().splitlines()[-1]
    assert last.split()[7] in HEAD_KERNELS, head.dispatch_table()


def test_backward_goes_through_pytorch():
    """Our ops define no backward; a call that needs gradients must take the PyTorch path, even when forced."""
    head = _head().cuda().bfloat16()
    features = torch.randn(1, 256, 2, 16, 24, device="cuda").bfloat16().requires_grad_()
    with backend("kernels"):
        video, _ = head(features)
        video.float().square().sum().backward()
    assert features.grad is not None and torch.isfinite(features.grad).all() and features.grad.abs().sum() > 0
