"""Wan head benchmark: one decode chunk (T=4 + 2 cached frames), 352x640, 256 -> 12, bf16, on one GPU.

Everything is timed in one process, side by side (ANCHORS.md's last table is the baseline to beat):
diffusers-style head (eager NCDHW / channels_last_3d / torch.compile), cuDNN conv3d alone, the 3x1x1 conv
alone, our split path (conv_n128 + head_stencil) with its layout conversions, and a copy of the input as the
floor. Each row is the median over reps of back-to-back calls between CUDA events (launch gaps overlap).
Run: python -m taesd_fast.apps.bench --sections head
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...graphs import graphed
from ...kernels import head_math
from ...kernels import head_stencil as hs
from ...kernels import split_bf16 as hk
from ...kernels.head_g_layout import pack_weight
from ...timing import time_ms

CL3D = torch.channels_last_3d


def time_ms_graphed(fn) -> float:
    return time_ms(graphed(fn))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def head_diffusers(feat, cache, gamma, weight, bias):
    """The head as diffusers runs it: fp32 RMS norm (F.normalize * sqrt(C) * gamma), SiLU, cat cache, conv3d, clamp."""
    y = F.normalize(feat.float(), dim=1) * feat.shape[1] ** 0.5 * gamma.float()
    y = F.silu(y.to(feat.dtype))
    x = torch.cat([cache, y], dim=2)
    return F.conv3d(x, weight, bias, padding=(0, 1, 1)).clamp(-1, 1)


def _full_head_rows(rows, feat, cache, gamma, w, b) -> None:
    """(i): the whole head as users run it (OutputHead.forward, unpatchify included) and the fused rows' paths."""
    from ... import dispatch
    from ...models.head.model import OutputHead
    from ...kernels import cuda_fused, gluon_fused, head_full_common, triton_fused

    head = OutputHead(feat.shape[1], w.shape[0]).to(feat.device, feat.dtype)
    with torch.no_grad():
        head.norm_out.gamma.copy_(gamma)
        head.conv_out.weight.copy_(w)
        head.conv_out.bias.copy_(b)
        with dispatch.backend("auto"):
            head(feat, cache)  # first call times the head_full candidates
            rows.append(("(i) OutputHead.forward, auto", time_ms(lambda: head(feat, cache)),
                         _choice(head)))
            rows.append(("(i) OutputHead.forward, auto, CUDA graph", time_ms_graphed(lambda: head(feat, cache)), ""))
        if triton_fused.TRITON_ERROR is None:
            eps, scale = head.norm_out.eps, feat.shape[1] ** 0.5
            fused = lambda row, **cfg: lambda: head_full_common.fused_head_with(  # noqa: E731
                row, feat, cache, gamma, w, b, eps, scale, **cfg)
            for row, module in (("cuda_fused", cuda_fused), ("gluon_fused", gluon_fused)):  # the Hopper g kernels
                if module.unsupported_reason(feat, cache) is None:
                    rows.append((f"(i) fused head (norm+SiLU+GEMM, then stencil), row {row}, graph",
                                 time_ms_graphed(fused(row)), "input read once: 692 MB = 0.163 ms"))
            rows.append(("(i) fused head, row triton_fused (roll), graph",
                         time_ms_graphed(fused("triton_fused", variant="roll")), ""))
            from ...kernels import triton_norm_split

            rows.append(("(i) Triton norm+SiLU window, then split conv, graph",
                         time_ms_graphed(lambda: triton_norm_split.head_full_norm_split(feat, cache, gamma, w, b, eps)), ""))
            rows.append(("(i) part: Triton norm+SiLU window alone, graph",
                         time_ms_graphed(lambda: triton_norm_split.activated_window(feat, cache, gamma, eps)),
                         "461 MB in + 461 MB out + 231 MB cache copied"))


def _choice(head) -> str:
    last = head.dispatch_table().splitlines()[-1].split()
    return "picked " + (last[7] if len(last) > 7 else "?")


def bench_head(T: int = 4, H: int = 352, W: int = 640, C: int = 256, C_out: int = 12,
               compile_: bool = True) -> list[tuple[str, float, str]]:
    """Rows (name, ms, note)."""
    dev, bf = "cuda", torch.bfloat16
    old = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark = True
    try:
        torch.manual_seed(0)
        feat = torch.randn(1, C, T, H, W, device=dev, dtype=bf)
        cache = F.silu(torch.randn(1, C, 2, H, W, device=dev)).to(bf)
        gamma = (1 + 0.1 * torch.randn(C, 1, 1, 1, device=dev)).to(bf)
        w = (torch.randn(C_out, C, 3, 3, 3, device=dev) * (0.6 / (27 * C) ** 0.5)).to(bf)
        b = (torch.randn(C_out, device=dev) * 0.1).to(bf)
        feat_cl, cache_cl, w_cl = (t.contiguous(memory_format=CL3D) for t in (feat, cache, w))
        x6 = torch.cat([cache, F.silu(torch.randn(1, C, T, H, W, device=dev)).to(bf)], dim=2)  # conv input
        x6_cl = x6.contiguous(memory_format=CL3D)
        mb = x6.numel() * x6.element_size() / 1e6
        wp, wp_cl = pack_weight(w).contiguous(), pack_weight(w).contiguous(memory_format=CL3D)
        rows: list[tuple[str, float, str]] = []

        def row(name, fn, note=""):
            rows.append((name, time_ms(fn), note))

        row("(a) diffusers head, eager NCDHW", lambda: head_diffusers(feat, cache, gamma, w, b))
        row("(b) diffusers head, eager channels_last_3d", lambda: head_diffusers(feat_cl, cache_cl, gamma, w_cl, b))
        if compile_:
            hc = torch.compile(head_diffusers)
            row("(c) diffusers head, torch.compile (NCDHW in)", lambda: hc(feat, cache, gamma, w, b))
        row("(d) cuDNN conv3d 3x3x3 + clamp, NCDHW", lambda: F.conv3d(x6, w, b, padding=(0, 1, 1)).clamp(-1, 1))
        row("(d) cuDNN conv3d 3x3x3 + clamp, channels_last_3d",
            lambda: F.conv3d(x6_cl, w_cl, b, padding=(0, 1, 1)).clamp(-1, 1))
        row("(e) 3x1x1 conv 256->112, cuDNN channels_last_3d", lambda: F.conv3d(x6_cl, wp_cl))
        row("(e) 3x1x1 conv 256->112, cuDNN NCDHW", lambda: F.conv3d(x6, wp))
        row("(f) split: conv_n128 + head_stencil, channels_last_3d in", lambda: hk.split_head_conv(x6_cl, w, b),
            "conv_n128 = cuDNN 3x1x1")
        row("(f) split: conv_n128 + head_stencil, NCDHW in", lambda: hk.split_head_conv(x6, w, b),
            "conv_n128 = cuBLAS Toeplitz GEMM, no layout conversion")
        row("(f) split, NCDHW in, converted to channels_last_3d first",
            lambda: hk.split_head_conv(x6.contiguous(memory_format=CL3D), w, b))
        row("(f) split, channels_last_3d, banded 64 rows", lambda: hk.split_head_conv(x6_cl, w, b, band_rows=64),
            "g bounded to 66 rows; cuDNN copies each band's x rows")
        row("(f) split, NCDHW, banded 64 rows", lambda: hk.split_head_conv(x6, w, b, band_rows=64),
            "g bounded to 66 rows; band of x read in place")
        rows.append(("(f) split, NCDHW in, CUDA graph replay", time_ms_graphed(lambda: hk.split_head_conv(x6, w, b)),
                     "no launch gaps"))
        rows.append(("(f) split, channels_last_3d in, CUDA graph replay",
                     time_ms_graphed(lambda: hk.split_head_conv(x6_cl, w, b)), "no launch gaps"))
        rows.append(("(f) split, NCDHW, banded 64 rows, CUDA graph replay",
                     time_ms_graphed(lambda: hk.split_head_conv(x6, w, b, band_rows=64)), "eager banded is launch-bound"))
        b32 = b.float()
        # Parts alone are timed as graph replays: eager, one op's Python launch path (~0.15 ms) exceeds the
        # stencil's GPU time, so back-to-back eager calls would time the CPU.
        graph_row = lambda name, fn, note="": rows.append((name, time_ms_graphed(fn), note))  # noqa: E731
        graph_row("(f) part: conv_n128 cuDNN form (channels_last_3d in), graph", lambda: hk.conv_n128(x6_cl, wp_cl))
        graph_row("(f) part: conv_n128 GEMM form (NCDHW in), graph", lambda: hk.conv_n128(x6, wp),
                  f"{2 * T * H * W * C * (T + 2) * 112 / 1e9:.0f} GFLOP incl. Toeplitz zeros")
        row("(f) part: conv_n128 cuDNN form on NCDHW in (+ g permute)", lambda: hk._conv_n128_cudnn(x6, wp))
        g_cl, g_pm = hk.conv_n128(x6_cl, wp_cl), hk.conv_n128(x6, wp)
        gb = g_cl.numel() * g_cl.element_size() / 1e6
        graph_row("(f) part: head_stencil alone, dense g, graph", lambda: hs.head_stencil(g_cl, b32, T, 0, H, H, 0),
                  f"reads g {gb:.0f} MB bf16, writes {T * H * W * C_out * 2 / 1e6:.0f} MB")
        graph_row("(f) part: head_stencil alone, pixel-major g, graph",
                  lambda: hs.head_stencil(g_pm, b32, T, 0, H, H, 0))
        row("(f) part: head_stencil alone, dense g, eager", lambda: hs.head_stencil(g_cl, b32, T, 0, H, H, 0),
            "launch-bound: Python op path")
        g_cl = g_pm = None  # free them before the copy row
        row("(g) copy of the conv input (floor)", lambda: x6.clone(), f"{mb:.0f} MB read + {mb:.0f} MB written")

        def head_split(feat, cache, gamma, weight, bias):
            window = head_math.causal_window(head_math.activate(feat, gamma, 1e-12), cache)
            return hk.split_head_conv(window, weight, bias)

        row("(h) full head, eager norm/SiLU/cat + split conv, NCDHW", lambda: head_split(feat, cache, gamma, w, b),
            "compare with (a)")
        _full_head_rows(rows, feat, cache, gamma, w, b)

        # Errors on the same conv input, against fp32 math on the bf16 values (TF32 off).
        torch.backends.cudnn.allow_tf32 = False
        ref = F.conv3d(x6.float(), w.float(), b.float(), padding=(0, 1, 1)).clamp(-1, 1)
        e_cudnn = _rel(F.conv3d(x6_cl, w_cl, b, padding=(0, 1, 1)).clamp(-1, 1), ref)
        e_split = _rel(hk.split_head_conv(x6_cl, w, b), ref)
        e_split_nc = _rel(hk.split_head_conv(x6, w, b), ref)
        e_band = _rel(hk.split_head_conv(x6, w, b, band_rows=64), ref)
        g32 = hk.conv_n128_ref(x6.float(), wp)
        e_g32 = _rel(hs.head_stencil(g32, b32, T, 0, H, H, 0).to(bf), ref)
        del g32, ref
        ms = {r[0]: r[1] for r in rows}
        rows.append(("errors vs fp32", 0.0, f"cuDNN bf16 {e_cudnn:.2e}; split bf16-g cl {e_split:.2e} "
                     f"(x{e_split / e_cudnn:.2f}), NCDHW {e_split_nc:.2e} (x{e_split_nc / e_cudnn:.2f}); "
                     f"banded {e_band:.2e}; f32-g {e_g32:.2e}"))
        rows.append(("speed-up: cuDNN conv3d cl / split cl",
                     ms["(d) cuDNN conv3d 3x3x3 + clamp, channels_last_3d"]
                     / ms["(f) split: conv_n128 + head_stencil, channels_last_3d in"], "x"))
        rows.append(("speed-up: cuDNN conv3d NCDHW / split NCDHW",
                     ms["(d) cuDNN conv3d 3x3x3 + clamp, NCDHW"]
                     / ms["(f) split: conv_n128 + head_stencil, NCDHW in"], "x"))
        rows.append(("speed-up: cuDNN conv3d cl (best cuDNN) / split NCDHW",
                     ms["(d) cuDNN conv3d 3x3x3 + clamp, channels_last_3d"]
                     / ms["(f) split: conv_n128 + head_stencil, NCDHW in"], "x"))
        return rows
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = old
