"""Benchmarks (they need a CUDA GPU): one table per section, everything timed side by side in one process.

    python -m taesd_fast.apps.bench [--sections conv,taesd,head] [--out FILE]

Each section is a function returning rows (dicts with the same keys); `format_rows` prints them.
Timing: taesd_fast.timing (CUDA events, warm-up, median of back-to-back runs).
Inputs are random normals (never zeros); one ~1M-pixel batch is larger than L2, so no rotation.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from ...timing import time_ms


def format_rows(title: str, rows: list[dict]) -> str:
    """Left-aligned text table; floats to 4 significant digits."""
    if not rows:
        return f"== {title}: no rows"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    table = [keys] + [[cell(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(keys))]
    lines = [f"== {title}"] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ conv

# (C_in, C_out, stride, H, epilogue): TAESD's 3x3 conv shapes; B is chosen so B*H*W ~ 1M input pixels.
CONV_SHAPES = [
    (64, 64, 1, 64, "bias+relu"), (64, 64, 1, 128, "bias+relu"), (64, 64, 1, 256, "bias+relu"),
    (64, 64, 2, 64, "bias"), (64, 64, 2, 128, "bias"), (64, 64, 2, 256, "bias"),
    (3, 64, 1, 256, "bias"), (64, 3, 1, 256, "bias"),
]


def _auto_choice(x, w, b, stride, relu) -> str:
    """What dispatch's auto mode picks for this call (times it if not cached)."""
    from ... import dispatch

    holder = torch.nn.Module()
    with dispatch.backend("auto"):
        dispatch.conv2d(x, w, b, stride=stride, relu=relu, layer=holder)
    ((_, rec),) = dispatch.rows_of(holder)
    return rec.choice


def bench_conv(shapes=CONV_SHAPES) -> list[dict]:
    """One 3x3 conv (f16, pad 1) per shape: each custom kernel vs cuDNN NCHW and channels_last."""
    from ..._backend import kernels_unavailable_reason
    from ...kernels import simt_conv

    torch.backends.cudnn.benchmark = True
    op = torch.ops.taesd_fast.conv3x3_f16
    kernels_ok = kernels_unavailable_reason() is None
    rows = []
    for cin, cout, stride, H, epi in shapes:
        B = max(1, (1 << 20) // (H * H))
        relu = "relu" in epi
        g = torch.Generator(device="cuda").manual_seed(H + cin + cout)
        x = torch.randn(B, cin, H, H, device="cuda", generator=g).half()
        w = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (3 * cin**0.5)).half()
        b = torch.randn(cout, device="cuda", generator=g).half()
        Ho = (H - 1) // stride + 1
        flop = 2.0 * B * cout * Ho * Ho * cin * 9
        x_cl, w_cl = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)

        def cudnn(x=x, w=w):
            y = F.conv2d(x, w, b, stride=stride, padding=1)
            return y.relu_() if relu else y

        impls = {"cudnn_nchw": cudnn, "cudnn_channels_last": lambda: cudnn(x_cl, w_cl)}
        if kernels_ok:
            for v in simt_conv.VARIANTS:
                if simt_conv.unsupported_reason(x.shape, w.shape, x.dtype, stride, v) is None:
                    impls[f"f16_{v}"] = lambda v=v: op(x, w, b, None, stride, relu, v)
        base = None
        for name, fn in impls.items():
            ms = time_ms(fn)
            base = ms if name == "cudnn_nchw" else base
            rows.append({"shape": f"{cin}->{cout} s{stride} {H}x{H} B={B} {epi}", "impl": name, "ms": ms,
                         "TFLOP/s": flop / ms / 1e9, "vs cudnn_nchw": base / ms})
        rows[-1]["auto picks"] = _auto_choice(x, w, b, stride, relu) if kernels_ok else "torch (kernels unavailable)"
    return rows


# ------------------------------------------------------------------------------------------ sections


def _taesd_rows(args) -> list[dict]:
    from .taesd import WORKLOADS, bench_taesd

    wanted = [w.strip() for w in (args.workloads or "").split(",") if w.strip()]
    workloads = [w for w in WORKLOADS if not wanted or any(s in w[0] for s in wanted)]
    return bench_taesd(workloads=workloads, compile_modes=() if args.no_compile else ("max-autotune",))


def _head_rows(args) -> list[dict]:
    from .head import bench_head

    return [{"what": n, "ms": ms, "note": note} for n, ms, note in bench_head()]


def _taehv_rows(args) -> list[dict]:
    from .taehv import section

    return section(args)


SECTIONS: dict[str, Callable[..., list[dict]]] = {"conv": lambda args: bench_conv(), "taesd": _taesd_rows,
                                                  "head": _head_rows, "taehv": _taehv_rows}


def main(argv=None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="conv,taesd,head", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", help="also write the tables to this file")
    ap.add_argument("--workloads", help="taesd, taehv sections: comma-separated substrings of workload names")
    ap.add_argument("--no-compile", action="store_true", help="taesd, taehv sections: skip torch.compile (minutes)")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:  # checked first: a typo is worth reporting on any machine
        ap.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if not torch.cuda.is_available():
        ap.exit(1, f"{ap.prog}: error: needs a CUDA GPU; torch {torch.__version__} sees none\n")
    header = f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}"
    out = [header]
    print(header, flush=True)
    from ... import dispatch

    with dispatch.tuning("blocking"):  # each auto row is timed with its tuned kernels, not PyTorch stand-ins
        for name in names:
            text = format_rows(name, SECTIONS[name](args))
            print(text, flush=True)
            out.append(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(out) + "\n")

