"""CPU checks of the fused conv pair (kernels/conv_tail.py) and its dispatch: argument errors, the tail weight
layout, the taps' sum kernel run by Triton's interpreter (in a subprocess: TRITON_INTERPRET=1 must be set before
Triton is imported), the op's CPU twin, and that the decoder hands its last Block and output conv over as a pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taesd_fast import TAESD, dispatch
from taesd_fast.kernels import conv_tail

REPO_ROOT = Path(__file__).resolve().parents[1]


def _pair(B=1, H=5, W=7, c2=3, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 64, H, W, generator=g).to(dtype)
    w = (torch.randn(64, 64, 3, 3, generator=g) / 24).to(dtype)
    b = (torch.randn(64, generator=g) * 0.5).to(dtype)
    r = torch.randn(B, 64, H, W, generator=g).to(dtype)
    w2 = (torch.randn(c2, 64, 3, 3, generator=g) / 24).to(dtype)
    b2 = (torch.randn(c2, generator=g) * 0.5).to(dtype)
    return x, w, b, r, w2, b2


def test_pack_tail_layout():
    w2 = torch.randn(3, 64, 3, 3).half()
    t = conv_tail.pack_tail(w2)
    assert t.shape == (64, conv_tail.TAIL_N) and t.dtype == torch.float16
    for dy, dx, c, ci in [(0, 0, 0, 0), (2, 1, 2, 63), (1, 2, 1, 17)]:
        assert t[ci, (3 * dy + dx) * 3 + c] == w2[c, ci, dy, dx]
    assert not t[:, 27:].any()


def test_errors_name_what_is_wrong():
    x, w, b, r, w2, b2 = _pair()
    with pytest.raises(ValueError, match=r"second weight must be \[C2, 64, 3, 3\]"):
        conv_tail.check_tail(x, w, b, r, w2[:, :32], b2)
    with pytest.raises(ValueError, match="second weight must be torch.float16"):
        conv_tail.check_tail(x, w, b, r, w2.float(), b2)
    with pytest.raises(ValueError, match=r"second bias must be torch.float16 \[3\]"):
        conv_tail.check_tail(x, w, b, r, w2, b2[:2])
    with pytest.raises(ValueError, match="residual"):
        conv_tail.check_tail(x, w, b, r[:, :, :4], w2, b2)


def test_unsupported_reasons():
    f16 = torch.float16
    assert "CPU" in conv_tail.unsupported_reason((1, 64, 8, 64), (64, 64, 3, 3), (3, 64, 3, 3), f16, "cpu", True)
    assert "at most 3" in conv_tail.unsupported_reason((1, 64, 8, 64), (64, 64, 3, 3), (4, 64, 3, 3), f16, "cuda",
                                                        True)
    assert "W=32" in conv_tail.unsupported_reason((1, 64, 8, 32), (64, 64, 3, 3), (3, 64, 3, 3), f16, "cuda", True)
    assert "f16" in conv_tail.unsupported_reason((1, 64, 8, 64), (64, 64, 3, 3), (3, 64, 3, 3), torch.float32,
                                                 "cuda", True)


def test_cpu_op_is_the_two_convs():
    x, w, b, r, w2, b2 = _pair(B=2, seed=1)
    y = torch.ops.taesd_fast.conv3x3_tail(x, w, b, r, True, w2, b2)
    h = torch.relu(torch.nn.functional.conv2d(x.float(), w.float(), b.float(), padding=1) + r.float()).half()
    ref = torch.nn.functional.conv2d(h.float(), w2.float(), b2.float(), padding=1).half()
    assert torch.equal(y, ref) and y.is_contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_tail.default, (x, w, b, r, True, w2, b2))


_CHILD = """
import json, torch
from taesd_fast.kernels import conv_tail
g = torch.Generator().manual_seed(3)
for B, H, W, c2, bias in [(2, 5, 7, 3, True), (1, 1, 9, 1, False), (1, 6, 3, 2, True)]:
    h = torch.randn(B, 64, H, W, generator=g).half()
    w2 = (torch.randn(c2, 64, 3, 3, generator=g) / 24).half()
    b2 = torch.randn(c2, generator=g).half() if bias else None
    # P as the row-streaming kernel stores it: every tap's contribution of every pixel, fp32
    p = torch.einsum("bchw,cn->bhwn", h.float(), conv_tail.pack_tail(w2).float()).contiguous()
    out = torch.full((B, c2, H, W), float("nan"), dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    conv_tail.tail_sum(p, b2, out)
    ref = torch.nn.functional.conv2d(h.double(), w2.double(), None if b2 is None else b2.double(), padding=1)
    torch_y = torch.nn.functional.conv2d(h, w2, b2, padding=1)
    rel = lambda a: ((a.double() - ref).norm() / ref.norm()).item()
    print(json.dumps({"case": [B, H, W, c2, bias], "nan": bool(out.isnan().any()), "err": rel(out),
                      "torch_err": rel(torch_y)}))
"""


def test_tail_sum_kernel_interpreted():
    pytest.importorskip("triton", reason="the interpreter check needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    assert len(lines) == 3
    for d in lines:
        assert not d["nan"], f"unwritten output elements in {d['case']}"
        assert d["err"] <= 2 * d["torch_err"] + 1e-7, d


def test_decoder_hands_over_the_last_block_and_output_conv(monkeypatch, isolated_dispatch):
    calls = []
    real = dispatch.conv2d_tail
    monkeypatch.setattr(dispatch, "conv2d_tail", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    model = TAESD("taesd").eval()
    z = torch.randn(1, 4, 4, 4)
    with torch.no_grad():
        y = model.decoder(z)
        plain = torch.nn.Sequential(*model.decoder)(z)  # every module on its own, no fused calls
    assert calls == [torch.Size([3, 64, 3, 3])]
    assert torch.equal(y, plain)
    table = dispatch.dispatch_table(model)
    assert "then 3x64x3x3" in table and "decoder.19" in table
