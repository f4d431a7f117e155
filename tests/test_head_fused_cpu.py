"""CPU checks of the fused head: its shared part (taesd_fast.kernels.head_full_common: the PyTorch twin against
OutputHead, the argument checks and fake impl, the op naming its row) and row triton_fused's g kernel itself
(taesd_fast.kernels.triton_fused) run by the Triton interpreter.

The interpreter must be switched on (TRITON_INTERPRET=1) before the kernels are decorated, i.e. before
triton_fused is imported, which this pytest process has already done. So the interpreter cases run in one
subprocess: this file run as a script, which prints one JSON line of measurements per case; the tests here assert
on them. head_stencil is a CUDA op, so the interpreter cases finish g with its twin head_stencil_ref.

Tolerance (as the GPU tests): ||out - ref|| / ||ref|| against an fp32 OutputHead at most 2x the error of
OutputHead's own bf16 path. The new cache may differ from OutputHead's where the fp32 norm lands on a bf16
rounding boundary (different summation order): that last-bit flip of the normed value moves SiLU's output by at
most 2 of its own bf16 steps; allowed in at most 0.1% of the elements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_output_head
from taesd_fast import OutputHead
from taesd_fast.kernels import head_full_common as common
from taesd_fast.kernels import head_stencil as hs
from taesd_fast.kernels import split_bf16 as hk
from taesd_fast.kernels import triton_fused as tf
from taesd_fast.kernels.head_g_layout import GC, pack_weight
from taesd_fast.kernels.triton_bf16 import INTERPRETED
from taesd_fast.kernels.triton_import import TRITON_ERROR

EPS = 1e-12
# (variant, B, C, T, H, W, with cache, block_m, block_k, seed): odd H/W; 9x8 = 72 pixels at block_m=32 gives
# three pixel blocks, the last partial; T=1 makes the new cache take an old cache frame (or a zero frame).
INTERP_CASES = [
    (v, *shape)
    for v in tf.VARIANTS
    for shape in [
        (1, 256, 1, 5, 7, False, 64, 64, 1),
        (1, 256, 1, 5, 7, True, 64, 64, 2),
        (1, 256, 2, 5, 7, True, 64, 64, 3),
        (2, 256, 3, 5, 7, True, 32, 64, 4),
        (1, 256, 3, 9, 8, False, 32, 128, 5),
        (2, 32, 4, 3, 5, True, 16, 16, 6),
    ]
]


def _head(c: int, seed: int, dtype=torch.float32) -> OutputHead:
    return random_output_head(c, seed).to(dtype)


def _inputs(b, c, t, h, w, with_cache, seed):
    """bf16 features (raw, any scale) and an activated-looking bf16 cache; fresh random, never zeros."""
    gen = torch.Generator().manual_seed(1000 + seed)
    features = (3 * torch.randn(b, c, t, h, w, generator=gen)).bfloat16()
    cache = torch.nn.functional.silu(torch.randn(b, c, 2, h, w, generator=gen)).bfloat16() if with_cache else None
    return features, cache


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _cache_mismatch(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements that differ, largest difference in bf16 steps of the reference value)."""
    diff = (got.float() - want.float()).abs()
    step = want.float().abs().clamp_min(2.0**-126) * 2.0**-7  # one bf16 step (8-bit significand), upper bound
    return (diff > 0).float().mean().item(), (diff / step).max().item()


def _references(head32: OutputHead, features, cache):
    """fp32 OutputHead (the reference) and OutputHead in bf16 (PyTorch's own bf16 path): (ref, bf16 out, cache)."""
    head16 = _head(head32.in_channels, 0, torch.bfloat16)
    head16.load_state_dict({k: v.bfloat16() for k, v in head32.state_dict().items()})
    with torch.no_grad():
        ref, _ = head32(features.float(), None if cache is None else cache.float())
        out16, cache16 = head16(features, cache)
    return ref, out16, cache16


# ------------------------------------------------------------------------------------- the interpreter worker


def _interp_case(variant, b, c, t, h, w, with_cache, block_m, block_k, seed) -> dict:
    """Run the g kernel under the interpreter on poisoned outputs; measure it against OutputHead and the twin."""
    head = _head(c, seed)
    features, cache = _inputs(b, c, t, h, w, with_cache, seed)
    gamma, weight, bias = (head.norm_out.gamma.bfloat16(), head.conv_out.weight.bfloat16(),
                           head.conv_out.bias.bfloat16())
    scale = head.in_channels ** 0.5
    g = torch.full((b, t, h, w, GC), float("nan"), dtype=torch.bfloat16)
    new_cache = torch.full((b, c, 2, h, w), float("nan"), dtype=torch.bfloat16)
    gs = (gamma.float().reshape(-1) * scale).contiguous()
    tf.launch_head_g(features, cache, gs, common.pack_weight_taps(weight), g, new_cache, EPS, variant=variant,
                     block_m=block_m, block_k=block_k, num_warps=4, num_stages=2)
    finite = bool(torch.isfinite(g).all() and torch.isfinite(new_cache).all())
    out = hs.head_stencil_ref(torch.nan_to_num(g), bias.float(), t, 0, h, h, 0)
    ref, out16, cache16 = _references(head, features, cache)
    # the twin's g: the same activation, conv_n128_ref (fp32 sum of the bf16 values, rounded once)
    act = common.activate_ref(features, gamma, EPS, scale)
    window = torch.cat([act.new_zeros(b, c, 2, h, w) if cache is None else cache, act], dim=2)
    g_twin = hk.conv_n128_ref(window, pack_weight(weight))
    mism, steps = _cache_mismatch(new_cache, cache16)
    return {
        "finite": finite,
        "err": _rel(out, ref),
        "torch_bf16_err": _rel(out16, ref),
        "g_vs_twin": ((g.float() - g_twin.float()).abs().max() / g_twin.float().abs().max()).item(),
        "cache_mismatch": mism,
        "cache_steps": steps,
        "clamped": (out.abs() == 1).float().mean().item(),
    }


def _worker() -> None:
    assert INTERPRETED, "run with TRITON_INTERPRET=1 set before triton is imported"
    for case in INTERP_CASES:
        print(json.dumps({"case": list(case), **_interp_case(*case)}), flush=True)


@pytest.fixture(scope="module")
def interp_results() -> dict:
    if TRITON_ERROR is not None:
        pytest.skip(f"triton interpreter unavailable: {TRITON_ERROR}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__], check=False, env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            results[tuple(rec.pop("case"))] = rec
    return results


@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_interpreted_kernel(interp_results, case):
    r = interp_results[case]
    assert r["finite"], "g or the new cache has NaN: an element was left unwritten"
    assert r["err"] <= 2 * r["torch_bf16_err"], f"kernel {r['err']:.3e} > 2x torch bf16 {r['torch_bf16_err']:.3e}"
    # Same maths as the twin; only the fp32 summation order inside tl.dot differs: a last bf16 bit at most.
    assert r["g_vs_twin"] <= 2.0**-8, r
    assert r["cache_mismatch"] <= 1e-3 and r["cache_steps"] <= 2.0, r
    assert r["clamped"] < 0.5, "test data mostly clamped: the comparison would be weak"


# ------------------------------------------------------------------------------------- in-process checks


@pytest.mark.parametrize("b,t,h,w,with_cache", [(1, 1, 5, 7, False), (2, 3, 4, 6, True), (1, 4, 3, 3, True)])
def test_twin_equals_output_head_fp32(b, t, h, w, with_cache):
    head = _head(32, seed=t)
    features, cache = _inputs(b, 32, t, h, w, with_cache, seed=t)
    features, cache = features.float(), None if cache is None else cache.float()
    with torch.no_grad():
        ref, ref_cache = head(features, cache)
    out, new_cache = common.fused_head_ref(features, cache, head.norm_out.gamma, head.conv_out.weight,
                                       head.conv_out.bias, EPS, head.in_channels ** 0.5)
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and new_cache.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_cache, ref_cache)  # the same activation code, bit for bit


@pytest.mark.parametrize("with_cache", [False, True])
def test_twin_bf16_error_budget(with_cache):
    head = _head(256, seed=7)
    features, cache = _inputs(2, 256, 3, 5, 7, with_cache, seed=7)
    ref, out16, cache16 = _references(head, features, cache)
    out, new_cache = common.fused_head_ref(features, cache, head.norm_out.gamma.bfloat16(),
                                       head.conv_out.weight.bfloat16(), head.conv_out.bias.bfloat16(), EPS,
                                       head.in_channels ** 0.5)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) <= 2 * _rel(out16, ref)
    assert torch.equal(new_cache, cache16)


def test_chunked_twin_equals_one_shot():
    head = _head(32, seed=8)
    features, _ = _inputs(1, 32, 4, 5, 6, False, seed=8)
    args = (head.norm_out.gamma, head.conv_out.weight, head.conv_out.bias, EPS, head.in_channels ** 0.5)
    features = features.float()
    one, one_cache = common.fused_head_ref(features, None, *args)
    a, cache = common.fused_head_ref(features[:, :, :1], None, *args)
    b, cache = common.fused_head_ref(features[:, :, 1:], cache, *args)
    torch.testing.assert_close(torch.cat([a, b], dim=2), one, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache, one_cache)


def test_pack_weight_taps_layout():
    w = torch.randn(12, 16, 3, 3, 3)
    wk = common.pack_weight_taps(w)
    assert wk.shape == (3, 16, 128) and wk.dtype == torch.bfloat16 and wk.is_contiguous()
    for k in range(3):
        for i in range(3):
            for j in range(3):
                n = (i * 3 + j) * 12
                assert torch.equal(wk[k, :, n: n + 12], w[:, :, k, i, j].t().bfloat16())
    assert not wk[:, :, 108:].any()  # padding columns are zeros, so the padded g channels are zeros


def _args(b=1, c=32, t=2, h=4, w=5, dtype=torch.bfloat16, device="cpu"):
    features = torch.randn(b, c, t, h, w, dtype=dtype, device=device)
    cache = torch.randn(b, c, 2, h, w, dtype=dtype, device=device)
    return [features, cache, torch.ones(c, 1, 1, 1, device=device), torch.randn(12, c, 3, 3, 3, device=device,
            dtype=dtype), torch.randn(12, device=device), EPS, c**0.5]


def test_op_refuses_cpu_and_non_bf16_with_clear_errors():
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        common.fused_head("triton_fused", *_args())
    args = _args(dtype=torch.float32)
    if torch.cuda.is_available():  # on a CUDA machine the dtype check is the one that fires
        args = _args(dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError, match="needs torch.bfloat16 features, got torch.float32"):
            common.fused_head("triton_fused", *args)
    else:
        with pytest.raises(ValueError, match="needs CUDA"):
            common.fused_head("triton_fused", *args)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.__setitem__(0, a[0][0]), r"features must be \[B, C, T, H, W\]"),
    (lambda a: a.__setitem__(1, a[1][:, :, :1]), r"cache must be the \[B, C, 2, H, W\]"),
    (lambda a: a.__setitem__(1, a[1].float()), r"cache must be the .*torch.float32"),
    (lambda a: a.__setitem__(2, torch.ones(31)), r"gamma must hold C=32"),
    (lambda a: a.__setitem__(3, a[3][:, :16]), r"weight must be \[C_out, 32, 3, 3, 3\]"),
    (lambda a: a.__setitem__(3, torch.randn(13, 32, 3, 3, 3).bfloat16()), r"9\*C_out <= 112"),
    (lambda a: a.__setitem__(4, torch.randn(11)), r"bias must be \[12\]"),
])
def test_shape_errors_name_expected_and_actual(mutate, match):
    args = _args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        common.fused_head("triton_fused", *args)
    with pytest.raises(ValueError, match=match):
        common.fused_head_ref(*args)


def test_unsupported_reason():
    assert "CUDA" in common.fused_head_unsupported_reason(*_args()[:5])
    assert "power of two" in common.kernel_reason(48, torch.bfloat16, "cuda")
    assert common.kernel_reason(256, torch.bfloat16, "cuda") is None
    assert "gamma must hold C=32" in common.fused_head_unsupported_reason(*_args()[:2], torch.ones(31), *_args()[3:5])


def test_the_op_names_its_row():
    """No kernel is picked inside the fused head: the caller names the row (the dispatcher measures which)."""
    for row in ("auto", "roll", "wgmma", "triton_norm_split"):
        with pytest.raises(ValueError, match=r"row must be one of \('cuda_fused', 'gluon_fused', 'triton_fused'\)"):
            common.fused_head_with(row, *_args())


def test_fake_impl_shapes_and_layouts():
    f = torch.empty(2, 256, 3, 5, 7, device="meta", dtype=torch.bfloat16)
    w = torch.empty(12, 256, 3, 3, 3, device="meta", dtype=torch.bfloat16)
    out, cache = common.fused_head("triton_fused", f, None, torch.empty(256, 1, 1, 1, device="meta"), w,
                               torch.empty(12, device="meta"), EPS, 16.0)
    assert out.shape == (2, 12, 3, 5, 7) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert cache.shape == (2, 256, 2, 5, 7) and cache.is_contiguous() and cache.dtype == torch.bfloat16


def test_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from taesd_fast.kernels import head_full_common, triton_fused as tf\n"
            "assert tf.launch_head_g and not tf.KERNELS\n"
            "print(tf.TRITON_ERROR)")
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton not importable" in proc.stdout


def test_set_default_config_checks_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        tf.set_default_config(blockm=64)
    for variant in ("nope", "auto", "wgmma"):  # the Triton kernel's variants only: the Hopper kernels are rows
        with pytest.raises(ValueError, match="variant"):
            tf.set_default_config(variant=variant)


if __name__ == "__main__":
    _worker()
