"""Where the Gluon head g kernel spends its time: variants of kernels/head_wgmma.py with one part removed each
(MMAs, SiLU, the norm), timed alone as CUDA-graph replays at the Wan chunk size. A diagnostic, not a test:
the variants compute wrong g. Run: python3 scripts/head_wgmma_probe.py
"""

from __future__ import annotations

import sys

import torch

from kernel_variants import load_variant, wan_head_chunk  # beside this script
from taesd_fast.kernels import head_fused as hf
from taesd_fast.kernels import head_wgmma
from taesd_fast.timing import graphed, time_ms

MMA = """            if s >= 2:
                acc_p = _mma(a, w_smem, 2 * KC + kc, acc_p, WIDE)
            if (s >= 1) & (s <= T):
                acc_q = _mma(a, w_smem, KC + kc, acc_q, WIDE)
            if s < T:
                acc_r = _mma(a, w_smem, kc, acc_r, WIDE)
"""
NARROW = """            out = (warpgroup_mma(a, w_smem[2].index(i).permute((1, 0)), acc[0], is_async=True),)"""
SILU = """                        gs = gl.load(gs_ptr + kc * 64 + ch)
                        y = (view.load(blk).to(gl.float32) * inv[None, :] * gs[:, None]).to(gl.bfloat16)
                        view.store(_silu(y.to(gl.float32)).to(gl.bfloat16))
"""
NORM = """                if s >= 2:
                    inv = _inv_norm("""
NO_NORM = """                if s >= 1000:
                    inv = _inv_norm("""
# Variants of the current kernel (earlier forms' variants ran at the trees BENCHMARKS.md names).
VARIANTS = {
    "baseline": [],
    "no MMA": [(MMA, "")],
    "no SiLU/write-back (norm kept)": [(SILU, "")],
    "no norm, no SiLU": [(NORM, NO_NORM)],
    "loads only (no MMA, norm, SiLU)": [(MMA, ""), (NORM, NO_NORM)],
    "no 16-column MMAs (narrow warpgroup idle)": [(NARROW, "            out = acc")],
    "no 16-column MMAs, no norm/SiLU": [(NARROW, "            out = acc"), (NORM, NO_NORM)],
}

def main() -> None:
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    x = wan_head_chunk(t)
    feat, cache, gamma, wt, gs, g, nc, c = x.feat, x.cache, x.gamma, x.wt, x.gs, x.g, x.nc, x.feat.shape[1]
    # g in fp32 from the unrounded activation: the variants' errors (only meaningful for those that compute all of g)
    act = hf.activate_ref(feat.float(), gamma.float(), 1e-12, c**0.5)
    win = torch.cat([cache.float(), act], 2)
    g_ref = sum(torch.einsum("nc,bcthw->bthwn", wt[k].float(), win[:, :, k:k + t]) for k in range(3))
    del act, win
    g_err = lambda gg: ((gg.float() - g_ref).norm() / g_ref.norm()).item()
    win_bf = torch.cat([cache, hf.activate_ref(feat, gamma, 1e-12, c**0.5)], 2)
    g_torch = sum(torch.einsum("nc,bcthw->bthwn", wt[k], win_bf[:, :, k:k + t]).float() for k in range(3))
    print(f"PyTorch bf16 g err vs fp32 {g_err(g_torch):.3e}", flush=True)
    del win_bf, g_torch
    for name, edits in VARIANTS.items():
        if only and not any(o in name for o in only):
            continue
        try:
            mod = load_variant(head_wgmma, name, edits)
            ms = time_ms(graphed(lambda mod=mod: mod.launch(feat, cache, gs, wt, g, nc, 1e-12)))
            print(f"{name:34s} {ms:8.4f} ms   g err vs fp32 {g_err(g):.3e}", flush=True)
        except Exception as err:  # noqa: BLE001  a diagnostic: report and go on
            print(f"{name:34s} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)


if __name__ == "__main__":
    main()
