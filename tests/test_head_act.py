"""Triton RMS norm + SiLU into the causal window (kernels/triton_norm_split.py).

CPU: the kernel runs in Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported). GPU: the real kernel, and the whole head through it. Both compare with the PyTorch activation
(kernels.head_math.activate + causal_window), which is what OutputHead's PyTorch path computes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from taesd_fast.kernels import head_math
from taesd_fast.kernels import triton_norm_split

_SCRIPT = textwrap.dedent("""
    import torch
    from taesd_fast.kernels import triton_norm_split, head_math
    triton_norm_split.POISON = True  # an element the kernel does not write stays NaN and fails the comparison
    torch.manual_seed(0)
    for b, c, t, h, w, with_cache in [(1, 32, 2, 5, 7, True), (2, 64, 1, 3, 9, False), (1, 256, 3, 4, 5, True)]:
        x = (torch.randn(b, c, t, h, w) * 3).bfloat16()
        gamma = (1 + 0.1 * torch.randn(c, 1, 1, 1)).bfloat16()
        cache = torch.nn.functional.silu(torch.randn(b, c, 2, h, w)).bfloat16() if with_cache else None
        got = triton_norm_split.activated_window(x, cache, gamma, 1e-12, block_p=16, bk=16)
        want = head_math.causal_window(head_math.activate(x, gamma, 1e-12), cache)
        assert got.shape == want.shape and got.is_contiguous(), (got.shape, want.shape)
        assert not got.isnan().any()
        bad = (got.float() - want.float()).abs().gt(0).float().mean().item()
        print(b, c, t, h, w, with_cache, "fraction differing", bad)
        assert bad <= 1e-3, bad  # F.normalize divides where the kernel multiplies by 1/||x||: a rare 1-ulp flip
""")


def test_interpreted_kernel_equals_pytorch_activation():
    pytest.importorskip("triton", reason="triton is not installed (the CPU test runs its interpreter)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("fraction differing") == 3


def test_refuses_what_it_cannot_run():
    assert triton_norm_split.unsupported_reason((1, 256, 4, 8, 8), torch.float32, "cuda") is not None
    assert triton_norm_split.unsupported_reason((1, 256, 4, 8, 8), torch.bfloat16, "cpu") is not None
    reason = triton_norm_split.unsupported_reason((1, 96, 4, 8, 8), torch.bfloat16, "cuda")
    assert reason is not None
    if triton_norm_split.TRITON_ERROR is None:
        assert "power of two" in reason


def test_op_cpu_twin_and_opcheck():
    torch.manual_seed(2)
    x = torch.randn(1, 32, 2, 3, 5).bfloat16()
    gamma = (1 + 0.1 * torch.randn(32, 1, 1, 1)).bfloat16()
    cache = torch.randn(1, 32, 2, 3, 5).bfloat16()
    got = triton_norm_split.activated_window_op(x, cache, gamma, 1e-12)
    assert torch.equal(got, head_math.causal_window(head_math.activate(x, gamma, 1e-12), cache))
    for c in (cache, None):
        torch.library.opcheck(torch.ops.taesd_fast.activated_window.default, (x, c, gamma, 1e-12))


@pytest.mark.skipif(not torch.cuda.is_available() or triton_norm_split.unsupported_reason(
    (1, 256, 1, 8, 8), torch.bfloat16, "cuda") is not None, reason="needs CUDA and triton")
@pytest.mark.parametrize("with_cache", [True, False])
def test_gpu_window_and_head(with_cache, monkeypatch):
    monkeypatch.setattr(triton_norm_split, "POISON", True)
    torch.manual_seed(1)
    b, c, t, h, w = 2, 256, 3, 37, 53  # pixels per frame not a multiple of the block
    x = (torch.randn(b, c, t, h, w, device="cuda") * 2).bfloat16()
    gamma = (1 + 0.1 * torch.randn(c, 1, 1, 1, device="cuda")).bfloat16()
    cache = torch.nn.functional.silu(torch.randn(b, c, 2, h, w, device="cuda")).bfloat16() if with_cache else None
    got = triton_norm_split.activated_window(x[:, :, :], cache, gamma, 1e-12)
    want = head_math.causal_window(head_math.activate(x, gamma, 1e-12), cache)
    assert not got.isnan().any()
    assert (got.float() - want.float()).abs().gt(0).float().mean().item() <= 1e-3
    weight = (torch.randn(12, c, 3, 3, 3, device="cuda") * (0.6 / (27 * c) ** 0.5)).bfloat16()
    bias = (0.1 * torch.randn(12, device="cuda")).bfloat16()
    out, new_cache = triton_norm_split.head_full_norm_split(x, cache, gamma, weight, bias, 1e-12)
    ref = torch.nn.functional.conv3d(want.double(), weight.double(), bias.double(), padding=(0, 1, 1)).clamp(-1, 1)
    torch_bf16 = torch.nn.functional.conv3d(want, weight, bias, padding=(0, 1, 1)).clamp(-1, 1)
    err = lambda o: ((o.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert torch.isfinite(out).all() and err(out) <= 2 * err(torch_bf16)
    assert torch.equal(new_cache, got[:, :, -2:])


@pytest.mark.skipif(not torch.cuda.is_available() or triton_norm_split.unsupported_reason(
    (1, 256, 1, 8, 8), torch.bfloat16, "cuda") is not None, reason="needs CUDA and triton")
def test_gpu_opcheck_compile_and_graph_capture():
    torch.manual_seed(4)
    x = torch.randn(1, 64, 2, 9, 11, device="cuda").bfloat16()
    gamma = (1 + 0.1 * torch.randn(64, 1, 1, 1, device="cuda")).bfloat16()
    cache = torch.randn(1, 64, 2, 9, 11, device="cuda").bfloat16()
    torch.library.opcheck(torch.ops.taesd_fast.activated_window.default, (x, cache, gamma, 1e-12))
    eager = triton_norm_split.activated_window_op(x, cache, gamma, 1e-12)
    compiled = torch.compile(lambda a, c: triton_norm_split.activated_window_op(a, c, gamma, 1e-12), fullgraph=True)
    assert torch.equal(compiled(x, cache), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_norm_split.activated_window_op(x, cache, gamma, 1e-12)
    x.copy_(torch.randn_like(x))  # fresh input: the replay must recompute, not replay stale values
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, triton_norm_split.activated_window(x, cache, gamma, 1e-12))


def test_long_videos_stay_off_the_int32_kernels():
    """The Triton head kernels index one sample with int32 offsets: a whole long video in one call (here 40 frames
    at 352x640, 256 channels: 2.3e9 elements per sample) must go to PyTorch, not to the kernel."""
    from taesd_fast.kernels import head_full_common

    big = torch.empty(1, 256, 40, 352, 640, device="meta", dtype=torch.bfloat16)
    chunk = torch.empty(1, 256, 4, 352, 640, device="meta", dtype=torch.bfloat16)
    assert not head_full_common.per_sample_offsets_fit(big) and head_full_common.per_sample_offsets_fit(chunk)
    assert not head_full_common.per_sample_offsets_fit(big[:, :, :4])  # a chunk view still strides over the whole video
    if triton_norm_split.TRITON_ERROR is None:
        assert "int32" in triton_norm_split.unsupported_reason(tuple(big.shape), torch.bfloat16, "cuda")
        assert triton_norm_split.unsupported_reason(tuple(chunk.shape), torch.bfloat16, "cuda") is None
