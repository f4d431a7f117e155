"""CPU checks of the memory-block conv (kind "mem_conv", row "triton_mem_conv", kernels/triton_mem_conv.py): its
PyTorch row equals the concatenation the memory block used to build, and the Triton kernel itself, run by Triton's
interpreter, matches a float64 reference within 2x PyTorch's own f16 error.

The kernel cases run in one subprocess with TRITON_INTERPRET=1 (set before triton is imported; it would turn every
Triton kernel of this process into Python), which prints one JSON line per case. Inputs are fresh random normals,
the memory frames differ from every frame of x, and the output is NaN-poisoned before every launch.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import interpret_cases, report_cases

CL = torch.channels_last

# (samples, frames per sample, C, C_out, H, W, memory, bias, relu, config (TMAConfig fields) or None)
CASES = {
    "64to64_three_frames": (1, 3, 64, 64, 5, 7, True, True, True, None),
    "two_samples_no_memory": (2, 3, 16, 48, 6, 9, False, True, False, (32, 4, 2, 8)),
    "one_frame_step": (2, 1, 32, 32, 4, 5, True, False, True, (16, 4, 2, 8)),
    "128to160_two_column_blocks": (1, 2, 128, 160, 3, 5, True, True, True, (16, 4, 2, 8)),
    "one_frame_256_out_small_grid_default": (1, 1, 32, 256, 4, 5, True, True, True, None),
    "one_frame_64_wide_blocks": (2, 1, 32, 192, 3, 5, True, True, True, (32, 4, 3, 8, 0, 64)),
}


def _inputs(samples, frames, c, c_out, h, w, memory, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples * frames, c, h, w, generator=gen).half().contiguous(memory_format=CL)
    mem = torch.randn(samples, c, h, w, generator=gen).half().contiguous(memory_format=CL) if memory else None
    weight = (torch.randn(c_out, 2 * c, 3, 3, generator=gen) / (18 * c) ** 0.5).half()
    b = (0.1 * torch.randn(c_out, generator=gen)).half() if bias else None
    return x, mem, weight, b


def _reference(x, memory, w, b, frames, relu, dtype):
    """The memory block's first conv as the model used to compute it: the past frames, the concatenation, a conv."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, memory, w, b = cast(x), cast(memory), cast(w), cast(b)
    n, c, h, wd = x.shape
    seq = x.reshape(n // frames, frames, c, h, wd)
    first = torch.zeros_like(seq[:, :1]) if memory is None else memory.unsqueeze(1)
    past = torch.cat([first, seq[:, :-1]], 1).reshape(n, c, h, wd)
    y = F.conv2d(torch.cat([x, past], 1), w, b, padding=1)
    return torch.relu(y) if relu else y


def _rel(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def _run_case(name: str) -> dict:
    from taesd_fast.kernels import triton_mem_conv
    from taesd_fast.kernels.triton_conv_tma import TMAConfig

    samples, frames, c, c_out, h, w, memory, bias, relu, cfg = CASES[name]
    x, mem, weight, b = _inputs(samples, frames, c, c_out, h, w, memory, bias, seed=len(name) * 131 + c)
    y = triton_mem_conv.mem_conv_launch(x, mem, weight, b, frames, relu,
                                        config=None if cfg is None else TMAConfig(*cfg))
    ref = _reference(x, mem, weight, b, frames, relu, torch.float64)
    low = _reference(x, mem, weight, b, frames, relu, torch.float16)
    return {"name": name, "nan": bool(y.isnan().any()), "cl": y.is_contiguous(memory_format=CL),
            "shape_ok": tuple(y.shape) == tuple(ref.shape), "err": _rel(y, ref),
            "worst": (y.double() - ref).abs().max().item(),
            "torch_err": _rel(low, ref), "torch_worst": (low.double() - ref).abs().max().item()}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from taesd_fast.kernels import conv_contract

    conv_contract.POISON_OUTPUT = True
    report_cases(CASES, _run_case)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpret_cases(__file__, expected=CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_within_2x_pytorch_f16(interpreted, name):
    got = interpreted[name]
    assert "error" not in got, got.get("error")
    assert got["shape_ok"] and got["cl"] and not got["nan"], got
    assert got["err"] <= 2 * got["torch_err"] and got["worst"] <= 2 * got["torch_worst"], got


def test_pytorch_row_is_the_concatenation_the_block_built():
    """The PyTorch row (CPU, backend torch, and wherever no kernel wins) computes exactly what the memory block did
    before it had a kind of its own: the past frames, cat([x, past]), one conv, ReLU."""
    from taesd_fast.dispatch import torch_ops

    for memory in (True, False):
        x, mem, weight, b = _inputs(2, 3, 8, 5, 4, 6, memory, True, seed=3)
        x, weight, b = x.float(), weight.float(), b.float()
        mem = None if mem is None else mem.float()
        assert torch.equal(torch_ops.mem_conv(x, mem, weight, b, 3, True),
                           _reference(x, mem, weight, b, 3, True, torch.float32))


def test_rule_names_what_it_cannot_take():
    from taesd_fast.kernels.triton_mem_conv import unsupported_reason

    cpu = torch.device("cpu")
    assert unsupported_reason((6, 64, 8, 8), (64, 128, 3, 3), torch.float16, 3, cpu) is None
    assert "2 x the input's 64" in unsupported_reason((6, 64, 8, 8), (64, 64, 3, 3), torch.float16, 3, cpu)
    assert "do not split into samples of 4" in unsupported_reason((6, 64, 8, 8), (64, 128, 3, 3), torch.float16, 4,
                                                                   cpu)
    assert "float16" in unsupported_reason((6, 64, 8, 8), (64, 128, 3, 3), torch.bfloat16, 3, cpu)
    assert "multiple of 64" in unsupported_reason((6, 96, 8, 8), (64, 192, 3, 3), torch.float16, 3, cpu)


def test_small_grids_take_more_programs():
    """The launch config follows the grid (the H200 sweep in BENCHMARKS.md, ninth session): a whole frame chunk keeps
    triton_conv_tma's config; one frame at 88x160 (110 tiles of 128 pixels, fewer than the 132 SMs) splits its 128
    channels in two blocks; one frame at 44x80 (30 tiles, 60 programs) also takes 8 x 8 pixel tiles."""
    from taesd_fast.kernels.triton_conv_tma import CPU_SMS, TMAConfig, default_config
    from taesd_fast.kernels.triton_mem_conv import mem_config

    cpu = torch.device("cpu")
    assert CPU_SMS == 132
    assert mem_config(64, (2, 64, 176, 320), cpu) == default_config(64)
    assert mem_config(256, (23, 256, 44, 80), cpu) == default_config(256)
    assert mem_config(128, (1, 128, 88, 160), cpu) == TMAConfig(128, 4, 3, 16, block_n=64)
    assert mem_config(128, (1, 128, 80, 128), cpu) == TMAConfig(128, 4, 3, 16, block_n=64)
    assert mem_config(256, (1, 256, 44, 80), cpu) == TMAConfig(64, 4, 3, 8, block_n=64)
    assert mem_config(256, (1, 256, 40, 64), cpu) == TMAConfig(64, 4, 3, 8, block_n=64)
    assert mem_config(64, (1, 64, 20, 30), cpu) == TMAConfig(64, 4, 3, 8, block_n=64)


if __name__ == "__main__" and "--interpret-cases" in sys.argv:
    _child_main()
