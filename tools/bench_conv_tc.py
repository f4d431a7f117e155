#!/usr/bin/env python3
"""Triton tensor-core 3x3 conv (taesd_fast::conv3x3_tc) vs cuDNN channels_last on TAESD's conv shapes.

    python3 tools/bench_conv_tc.py --out /path/to/bench_conv_tc.txt [--budget-s 150] [--quick]

For each shape: correctness of every config (NaN-poisoned output; rel error vs an fp32 conv of the same f16 inputs,
TF32 off, must be <= 2x cuDNN's own f16 error), then GPU time of a small config sweep (BLOCK_M, num_warps,
num_stages, block_k) against
  * "cudnn model ops": what the model runs today, op by op, channels_last: [tanh(x/3)*3] [interpolate] conv(+bias)
    [+ residual] [relu], each a separate PyTorch op (as dispatch._torch_conv2d does);
  * "cudnn conv only": F.conv2d(x, w, b) alone (what a perfect epilogue fusion on cuDNN's conv could reach).
Times are medians of CUDA-event-timed CUDA-graph replays (GPU time without launch gaps; taesd_fast.timing); the
"eager ms" column is the plain Python call of the default config, launch overhead included.
TFLOP/s count the equivalent unfolded 3x3 conv on the output grid (the upsample fold does 4/9 of those MACs).
"floor ms" is the fused kernel's DRAM traffic (x, residual, y) at 4.24 TB/s.
One failing config is reported and skipped; configs beyond --budget-s seconds are skipped (default one first).
Writes only to --out (and stdout).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast.kernels import conv_tc as tc  # noqa: E402
from taesd_fast.timing import graphed, time_ms  # noqa: E402

HBM_TBS = 4.24

# name, B, C_in, C_out, H, W (input), stride, upsample, bias, residual, relu, pre_clamp
SHAPES = [
    ("64->64 s1 256^2 B64 b+r+relu", 64, 64, 64, 256, 256, 1, 1, True, True, True, False),
    ("64->64 s1 256^2 B64 b+relu", 64, 64, 64, 256, 256, 1, 1, True, False, True, False),
    ("up2+64->64 128->256^2 B64", 64, 64, 64, 128, 128, 1, 2, False, False, False, False),
    ("64->64 s1 128^2 B64 b+relu", 64, 64, 64, 128, 128, 1, 1, True, False, True, False),
    ("64->64 s1 64^2 B64 b+relu", 64, 64, 64, 64, 64, 1, 1, True, False, True, False),
    ("64->64 s1 32^2 B64 b+relu", 64, 64, 64, 32, 32, 1, 1, True, False, True, False),
    ("64->64 s2 256->128^2 B16", 16, 64, 64, 256, 256, 2, 1, False, False, False, False),
    ("64->3 s1 256^2 B64 b", 64, 64, 3, 256, 256, 1, 1, True, False, False, False),
    ("clamp+4->64 32^2 B64 b+relu", 64, 4, 64, 32, 32, 1, 1, True, False, True, True),
    ("clamp+16->64 32^2 B64 b+relu", 64, 16, 64, 32, 32, 1, 1, True, False, True, True),
    ("3->64 s1 256^2 B64 b+relu (encoder stem)", 64, 3, 64, 256, 256, 1, 1, True, False, True, False),
    # B=1 (live previews): grids of a few dozen tiles at most; small tiles spread them over the SMs
    ("B1 64->64 s1 32^2 b+r+relu", 1, 64, 64, 32, 32, 1, 1, True, True, True, False),
    ("B1 64->64 s1 64^2 b+relu", 1, 64, 64, 64, 64, 1, 1, True, False, True, False),
    ("B1 64->64 s1 128^2 b+relu", 1, 64, 64, 128, 128, 1, 1, True, False, True, False),
    ("B1 64->64 s1 256^2 b+relu", 1, 64, 64, 256, 256, 1, 1, True, False, True, False),
    ("B1 64->64 s1 1024^2 b+r+relu", 1, 64, 64, 1024, 1024, 1, 1, True, True, True, False),
    ("B1 up2+64->64 64->128^2", 1, 64, 64, 64, 64, 1, 2, False, False, False, False),
    ("B1 64->3 s1 256^2 b", 1, 64, 3, 256, 256, 1, 1, True, False, False, False),
]

TMA = lambda m, tw, w, st, p=0: tc.TCConfig(m, w, st, tile_w=tw, persistent=p)  # noqa: E731
HALO = lambda hw: tc.TCConfig(128, 4, 3, tile_w=16, halo_w=hw)  # noqa: E731  (falls back to TMA where it can't)
TAP_SWEEP = [HALO(128), HALO(64), TMA(128, 16, 4, 3, 1), TMA(128, 16, 4, 3, 2), TMA(128, 16, 4, 3, 3), TMA(128, 16, 4, 4, 2),
             TMA(128, 32, 4, 3, 2), TMA(256, 16, 8, 3, 1), TMA(128, 16, 8, 3, 2),
             TMA(128, 16, 4, 3), TMA(128, 32, 4, 3), TMA(256, 16, 8, 3), TMA(128, 16, 4, 2), tc.TCConfig(128, 4, 3)]
SMALL_SWEEP = [HALO(128), HALO(64), TMA(64, 8, 4, 3), TMA(64, 16, 4, 3), TMA(32, 8, 4, 3), TMA(128, 16, 4, 3), tc.TCConfig(32, 4, 3),
               tc.TCConfig(64, 4, 3), tc.TCConfig(128, 4, 3)]
FLAT_SWEEP = [tc.TCConfig(64, 4, 2), tc.TCConfig(128, 4, 2), tc.TCConfig(128, 8, 2), tc.TCConfig(256, 8, 2)]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64, in chunks (the big shapes have 268M elements)."""
    num = den = 0.0
    a, ref = a.reshape(-1), ref.reshape(-1)
    for i in range(0, a.numel(), 1 << 26):
        d, r = a[i: i + (1 << 26)].double(), ref[i: i + (1 << 26)].double()
        num += (d - r).pow(2).sum().item()
        den += r.pow(2).sum().item()
    return (num / den) ** 0.5


def model_ops(*args):
    """Today's path, op by op (channels_last in, channels_last out)."""
    return tc.conv3x3_math(*args)


def fp32_reference(*args):
    return tc.conv3x3_math(*args, dtype=torch.float32)


def gpu_ms(fn) -> float:
    """Median ms of CUDA-graph replays of fn (falls back to eager timing if capture fails)."""
    try:
        return time_ms(graphed(fn))
    except Exception:  # noqa: BLE001 - a capture problem must not hide the number
        torch.cuda.synchronize()
        return time_ms(fn)


def bench_shape(spec, budget_end: float, quick: bool) -> list[dict]:
    name, B, cin, cout, H, W, stride, up, bias, res, relu, pre_clamp = spec
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    cl = torch.channels_last
    x = torch.randn(B, cin, H, W, device="cuda", generator=g).half().contiguous(memory_format=cl)
    w = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (3 * cin**0.5)).half().contiguous(memory_format=cl)
    b = (torch.randn(cout, device="cuda", generator=g) * 0.5).half() if bias else None
    oshape = tc.output_shape(x.shape, w.shape, stride, up)
    r = torch.randn(oshape, device="cuda", generator=g).half().contiguous(memory_format=cl) if res else None
    args = (x, w, b, r, stride, relu, up, pre_clamp)
    flop = tc.flops(x.shape, w.shape, stride, up)
    n_out = torch.Size(oshape).numel()
    nbytes = 2 * (x.numel() + n_out + (n_out if res else 0))  # f16 x, y and residual
    floor = nbytes / (HBM_TBS * 1e12) * 1e3
    row = lambda impl, cfg, ms, **kw: {"shape": name, "impl": impl, "cfg": cfg, "ms": ms,  # noqa: E731
                                       "TFLOP/s": flop / ms / 1e9 if ms else "", "floor ms": floor, **kw}

    torch.backends.cudnn.allow_tf32 = False
    ref = fp32_reference(*args)
    torch.backends.cudnn.allow_tf32 = True
    y_torch = model_ops(*args)
    torch_err = rel(y_torch, ref)
    del y_torch
    rows = []
    base = gpu_ms(lambda: model_ops(*args))
    rows.append(row("cudnn model ops", "-", base, **{"vs cudnn": 1.0, "err": torch_err}))
    conv_only = gpu_ms(lambda: F.conv2d(x, w, b, stride=stride, padding=1) if up == 1 else
                       F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, b, padding=1))
    rows.append(row("cudnn conv only" if up == 1 else "cudnn interp+conv", "-", conv_only,
                    **{"vs cudnn": base / conv_only}))

    M = B * (H * W if up == 2 else oshape[2] * oshape[3])
    default = tc.default_config(cin, cout, stride, up, M)
    small = M * (-(-cout // 128)) < 132 * 128  # less than one wave of 128-row tiles on an H200
    sweep = [default] + [c for c in (FLAT_SWEEP if cin < 16 else SMALL_SWEEP if small else TAP_SWEEP)
                         if c != default and not (c.tile_w and (stride != 1 or pre_clamp))]  # TMA: stride 1, no clamp
    if quick:
        sweep = sweep[:2]
    y = torch.empty(oshape, dtype=torch.float16, device="cuda", memory_format=cl)
    for i, cfg in enumerate(sweep):
        if i > 0 and time.time() > budget_end:
            rows.append(row("triton", str(cfg), None, note="skipped (time budget)"))
            continue
        try:
            tc.POISON_OUTPUT = True
            tc.conv3x3_tc_launch(*args, config=cfg, out=y)
            torch.cuda.synchronize()
            tc.POISON_OUTPUT = False
            nan = bool(y.isnan().any())
            err = rel(y, ref)
            ok = not nan and err <= 2 * torch_err + 1e-7
            ms = gpu_ms(lambda cfg=cfg: tc.conv3x3_tc_launch(*args, config=cfg, out=y))
            extra = {"vs cudnn": base / ms, "err": err, "ok": "ok" if ok else ("NaN" if nan else "ERR>2x")}
            if i == 0:
                extra["eager ms"] = time_ms(lambda: tc.conv3x3_tc_launch(*args, config=cfg, out=y))
            rows.append(row("triton" + (" (default)" if i == 0 else ""), str(cfg), ms, **extra))
        except Exception as e:  # noqa: BLE001 - one bad config (e.g. out of shared memory) must not stop the sweep
            tc.POISON_OUTPUT = False
            torch.cuda.synchronize()
            rows.append(row("triton", str(cfg), None, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}"))
    return rows  # the tensors die with this frame; main() empties the cache between shapes


def fmt(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    table = [keys] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(t, widths)).rstrip() for t in table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="file to write the report to")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping extra configs after this many seconds")
    ap.add_argument("--quick", action="store_true", help="default config + one other per shape")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run (default all)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not tc.triton_available("cuda"):
        sys.exit(f"needs CUDA and Triton: {tc.triton_unavailable_reason('cuda')}")
    import triton

    torch.backends.cudnn.benchmark = True
    t0 = time.time()
    head = (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"cuDNN {torch.backends.cudnn.version()}")
    print(head, flush=True)
    wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
    rows, best = [], []
    for spec in SHAPES:
        if wanted and not any(wd in spec[0] for wd in wanted):
            continue
        try:
            shape_rows = bench_shape(spec, t0 + args.budget_s, args.quick)
        except Exception as e:  # noqa: BLE001 - e.g. OOM on a smaller GPU: report and go on
            shape_rows = [{"shape": spec[0], "impl": "-", "note": f"failed: {type(e).__name__}: {str(e)[:100]}"}]
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        rows += shape_rows
        print(fmt(shape_rows), flush=True)
        good = [r for r in shape_rows if r["impl"].startswith("triton") and r.get("ok") == "ok"]
        if good:
            top = min(good, key=lambda r: r["ms"])
            best.append(f"{spec[0]:42s} best {top['cfg']:12s} {top['ms']:.4g} ms  {top['vs cudnn']:.2f}x vs cudnn model ops"
                        f"  (cudnn model ops {shape_rows[0]['ms']:.4g} ms, conv only {shape_rows[1]['ms']:.4g} ms,"
                        f" floor {top['floor ms']:.3g} ms)")
    text = "\n".join([head, "", fmt(rows), "", "best config per shape:", *best,
                      f"\ntotal {time.time() - t0:.0f} s"])
    print("\nbest config per shape:\n" + "\n".join(best) + f"\ntotal {time.time() - t0:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
