"""The split head's kernels (kernels/split_bf16.py: conv_n128's GEMM / cuDNN forms, then our NVRTC stencil,
kernels/head_stencil.py and csrc/head_bf16.cu) on small odd shapes, for compute-sanitizer memcheck / racecheck
(tools/sanitize.sh).

    python3 tools/head_sanitize.py

For NCDHW and channels_last_3d windows and C_out 12 and 3 (3: the scalar, non-vector load path):
  * split_head_conv, whole frame and in bands of 4 rows (clipped halos at both borders), against the float64 conv3d
    + clamp, next to PyTorch's own bf16 error (the bound is 2x that);
  * the raw stencil launch into a NaN-poisoned output, from a bf16 and an fp32 g and, where C_out allows it (12),
    writing the video (patch 2): bit-equal to its PyTorch twin head_stencil_ref (same tap order).
References run on the CPU (no cuDNN fp32 conv under the sanitizer). Exits 1 if any check failed; ends with
"sanitize script done".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kernel_checks import Tally, has_nan, rel_err

from taesd_fast.kernels import head_stencil as hs
from taesd_fast.kernels import split_bf16 as hk
from taesd_fast.kernels.head_g_layout import pack_weight


def check_stencil(tally: Tally, what: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    """The stencil kernel alone, into poisoned outputs, against its twin on the same g."""
    _, _, frames, h, _ = x.shape
    t = frames - 2
    g64 = hk.conv_n128_ref(x.cpu().float(), pack_weight(w.cpu().float()))  # pixel-major g, as the GEMM gives
    n_out = b.shape[0]
    for g_dtype in (torch.bfloat16, torch.float32):
        for patch in (p for p in (0, 2) if p == 0 or n_out % (p * p) == 0):  # unpatchify needs C_out % p² == 0
            g_cpu = g64.to(g_dtype)
            want = hs.head_stencil_ref(g_cpu, b.cpu(), t, 0, h, h, 0, patch)
            out = torch.full_like(want, float("nan"), device="cuda")  # want's strides: the kernel's output layout
            hs.launch_head_stencil(g_cpu.cuda(), b.float(), out, 0, h, 0, patch)
            torch.cuda.synchronize()
            label = f"{what} g {str(g_dtype)[6:]} patch {patch}"
            ok = not has_nan(out) and torch.equal(out.cpu(), want)
            diff = "NaN" if has_nan(out) else f"max diff {(out.cpu().float() - want.float()).abs().max().item():.2e}"
            print(f"{'head_stencil':20s} {label:44s} {diff} vs twin  {'ok' if ok else 'MISMATCH'}", flush=True)
            tally.record("head_stencil", label, ok)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = F.silu(torch.randn(2, 256, 6, 13, 21, device="cuda", generator=g)).bfloat16()
    tally = Tally()
    for layout in ("ncdhw", "cl3d"):  # GEMM form + pixel-major g / cuDNN form + dense g
        xl = x.contiguous(memory_format=torch.channels_last_3d) if layout == "cl3d" else x
        for c_out in (12, 3):
            w = (torch.randn(c_out, 256, 3, 3, 3, device="cuda", generator=g) * (0.6 / (27 * 256) ** 0.5)).bfloat16()
            b = (torch.randn(c_out, device="cuda", generator=g) * 0.1).bfloat16()
            x_cpu, w_cpu, b_cpu = x.cpu(), w.cpu(), b.cpu()
            ref = F.conv3d(x_cpu.double(), w_cpu.double(), b_cpu.double(), padding=(0, 1, 1)).clamp(-1, 1)
            torch_err = rel_err(F.conv3d(x_cpu, w_cpu, b_cpu, padding=(0, 1, 1)).clamp(-1, 1), ref)
            what = f"{layout} C_out={c_out}"
            for band_rows in (None, 4):
                try:
                    out = hk.split_head_conv(xl, w, b, band_rows=band_rows)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - report every case, not just the first that breaks
                    tally.fail("split_head_conv", what, f"{type(e).__name__}: {e}")
                    continue
                tally.check("split_head_conv", what + (f" bands of {band_rows}" if band_rows else ""), out, ref,
                            torch_err)
            if layout == "ncdhw":
                check_stencil(tally, what, x, w, b)
    return tally.exit_code()


if __name__ == "__main__":
    sys.exit(main())
