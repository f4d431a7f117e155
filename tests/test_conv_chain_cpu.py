"""CPU checks of taesd_fast::block_chain (kernels/conv_chain.py) and of how runs of Blocks reach it: argument checks,
the PyTorch twin against a float64 model, opcheck, the dispatcher's `blocks` call and the Triton kernel itself under
Triton's interpreter (one program: with more, the interpreter would run the grid barrier's programs one after
another and never open it; the GPU tests run real grids).

The interpreter cases run in a subprocess (TRITON_INTERPRET=1 must be set before triton is imported), one JSON line
per case, as in test_conv_tc_cpu.py. Inputs are fresh random normals; outputs and scratch are NaN-poisoned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast.kernels import conv_chain as cc
from taesd_fast.layers import Block, ReLUSequential, _plain_block_run, name_layers

REPO_ROOT = Path(__file__).resolve().parents[1]
CL = torch.channels_last


def _make(B, H, W, n_blocks, seed=0, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 64, H, W, generator=gen).to(dtype).contiguous(memory_format=CL)
    ws = [(torch.randn(64, 64, 3, 3, generator=gen) / 24).to(dtype) for _ in range(3 * n_blocks)]
    bs = [(torch.randn(64, generator=gen) * 0.2).to(dtype) for _ in range(3 * n_blocks)]
    return x, ws, bs


def _model64(x, ws, bs):
    """The Blocks in float64: relu(c3(relu(c2(relu(c1(h))))) + h) per block."""
    h = x.double()
    for i in range(0, len(ws), 3):
        t = F.conv2d(h, ws[i].double(), bs[i].double(), padding=1).relu()
        t = F.conv2d(t, ws[i + 1].double(), bs[i + 1].double(), padding=1).relu()
        h = (F.conv2d(t, ws[i + 2].double(), bs[i + 2].double(), padding=1) + h).relu()
    return h


def _per_conv_f16(x, ws, bs):
    """PyTorch's own f16 path: each conv, + skip and ReLU as separate f16 ops (the error the kernel is held to)."""
    h = x
    for i in range(0, len(ws), 3):
        t = F.conv2d(h, ws[i], bs[i], padding=1).relu()
        t = F.conv2d(t, ws[i + 1], bs[i + 1], padding=1).relu()
        h = (F.conv2d(t, ws[i + 2], bs[i + 2], padding=1) + h).relu()
    return h


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def test_twin_matches_float64_model_within_pytorch_error():
    x, ws, bs = _make(2, 6, 7, 2, seed=3)
    ref = _model64(x, ws, bs)
    y = cc.block_chain_ref(x, ws, bs)
    assert y.is_contiguous(memory_format=CL) and y.dtype == torch.float16
    assert _rel(y, ref) <= 2 * _rel(_per_conv_f16(x, ws, bs), ref)


def test_shape_reasons_and_errors():
    f16 = torch.float16
    assert cc.shape_reason((1, 64, 32, 32), f16, 3) is None
    assert "float16" in cc.shape_reason((1, 64, 8, 8), torch.float32, 1)
    assert "[B, 64, H, W]" in cc.shape_reason((1, 32, 8, 8), f16, 1)
    assert "1..3" in cc.shape_reason((1, 64, 8, 8), f16, 4)
    assert "pixels" in cc.shape_reason((1, 64, 2048, 2048), f16, 1)
    x, ws, bs = _make(1, 5, 5, 1)
    op = torch.ops.taesd_fast.block_chain
    with pytest.raises(ValueError, match="3 weights and 3 biases per block"):
        op(x, ws[:2], bs[:2])
    with pytest.raises(ValueError, match="64->64 3x3 with a bias"):
        op(x, [ws[0], ws[1], ws[2][:, :, :1, :1]], bs)
    with pytest.raises(ValueError, match="weights and biases must be torch.float16"):
        op(x, [w.float() for w in ws], bs)
    with pytest.raises(ValueError, match=r"expected \[B, 64, H, W\]"):
        op(x[:, :32], ws, bs)


def test_opcheck_cpu():
    x, ws, bs = _make(1, 4, 5, 1, seed=1)
    torch.library.opcheck(torch.ops.taesd_fast.block_chain.default, (x, ws, bs))


def test_plain_block_runs():
    plain = [Block(64, 64) for _ in range(4)]
    pooled, widened = Block(64, 64, midblock_gn=True), Block(32, 64)
    mods = [pooled, *plain[:2], widened, *plain]
    assert _plain_block_run(mods, 0) == []  # a pool branch ends (here: prevents) a run
    assert _plain_block_run(mods, 1) == plain[:2]  # a skip conv ends it
    assert _plain_block_run(mods, 4) == plain[:3]  # at most 3 per run
    assert _plain_block_run(mods, 7) == plain[3:]


def test_blocks_on_cpu_run_per_conv_and_match_the_modules():
    torch.manual_seed(0)
    seq = ReLUSequential(*(Block(64, 64) for _ in range(3))).eval().requires_grad_(False)
    name_layers(seq)
    x = torch.randn(1, 64, 6, 5)
    with dispatch.backend("auto"):
        y = seq(x)
    expect = x
    for block in seq:
        expect = block(expect)
    assert torch.equal(y, expect)
    table = dispatch.dispatch_table(seq)
    assert "3 blocks" in table and "per_conv" in table, table  # the run's row, and its convs' rows
    assert "0.conv.0" in table


# --------------------------------------------------------------------------- the kernel, under the interpreter

# (B, H, W, n_blocks): odd sizes and a last tile that is partly outside the image
CASES = {"1block_5x7": (1, 5, 7, 1), "2blocks_b2_9x6": (2, 9, 6, 2), "3blocks_8x8_full_tiles": (1, 8, 8, 3),
         "3blocks_b3_3x5": (3, 3, 5, 3)}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cc.POISON_OUTPUT = True
    for name, (B, H, W, n) in CASES.items():
        try:
            x, ws, bs = _make(B, H, W, n, seed=len(name))
            y = torch.ops.taesd_fast.block_chain(x, ws, bs)
            ref = _model64(x, ws, bs)
            print(json.dumps({"name": name, "nan": bool(y.isnan().any()), "cl": y.is_contiguous(memory_format=CL),
                              "err": _rel(y, ref), "torch_err": _rel(_per_conv_f16(x, ws, bs), ref),
                              "launched": len(cc._launched)}), flush=True)
        except Exception as e:  # report, so the parent names the failing case
            print(json.dumps({"name": name, "error": f"{type(e).__name__}: {e}"}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    try:
        import triton  # noqa: F401
    except Exception as e:
        pytest.skip(f"triton not installed ({type(e).__name__}: {e}): the interpreter checks need it")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--interpret-cases"], check=False, env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    results = {json.loads(line)["name"]: json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")}
    if proc.returncode != 0 or set(results) != set(CASES):
        pytest.fail(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interpreted, name):
    d = interpreted[name]
    assert "error" not in d, d.get("error")
    assert d["cl"] and not d["nan"], d
    assert d["launched"] >= 1, "the op ran the twin, not the kernel"
    assert d["err"] <= 2 * d["torch_err"], f"rel err {d['err']:.3g} > 2 x PyTorch f16 error {d['torch_err']:.3g}"


if __name__ == "__main__" and "--interpret-cases" in sys.argv:
    _child_main()
