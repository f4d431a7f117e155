"""Every conv2d kernel row (taesd_fast/kernels/rows.py) against cuDNN on TAESD's and TAEHV's 3x3 conv shapes, as
CUDA-graph replays.

    python3 tools/bench_conv_tc.py --out /path/to/bench_conv_tc.txt [--shapes FILTER] [--budget-s 150] [--quick]

For each shape, side by side:
  * "cudnn model ops cl" / "cudnn model ops nchw": what the model runs without kernels, op by op (the dispatcher's
    PyTorch row: [tanh(x/3)*3] [interpolate] conv(+bias) [+ residual] [relu]), channels_last and NCHW;
  * "cudnn conv cl" / "cudnn conv nchw": F.conv2d alone ([interpolate +] conv + bias): what a perfect epilogue fusion
    on cuDNN's conv could reach;
  * every conv2d kernel row through its own `run`, on inputs in the layout it reads natively; a row whose support
    rule refuses the shape is listed with its reason;
  * unless --quick, a sweep of the launch configs the two Triton rows still take (triton_conv.TCConfig through
    conv3x3_tc_launch, triton_conv_tma.TMAConfig through conv3x3_tma_launch), the row's default first; configs past
    --budget-s seconds are listed as skipped. The Gluon and CUDA C++ rows have no configs (their launch shapes
    follow from the problem).
Before it is timed, each kernel runs once with NaN-poisoned outputs and its relative error against the float64 maths
(conv_contract.conv3x3_math) must be <= 2x that of the cuDNN model ops in f16 ("ok", else "NaN" / "ERR>2x").
Times: medians of CUDA-event-timed graph replays (taesd_fast.timing: GPU time without launch gaps); "eager ms" is
the row's plain Python call, launch overhead included. TFLOP/s count the equivalent unfolded 3x3 conv on the output
grid (the upsample fold does 4/9 of those MACs). "floor ms": the fused conv's DRAM traffic (x, residual, y) at
4.24 TB/s (H200). The report is rewritten after each shape (a timeout keeps what was done); it writes only --out.
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

from kernel_checks import poisoned, rel_err, verdict

from taesd_fast.dispatch import Spec, torch_ops
from taesd_fast.kernels import conv_contract, triton_conv, triton_conv_tma
from taesd_fast.kernels import rows as kernel_rows
from taesd_fast.timing import graphed, time_ms

HBM_TBS = 4.24
CL = torch.channels_last

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
    # B=1 (live previews): grids of a few dozen tiles at most
    ("B1 64->64 s1 32^2 b+r+relu", 1, 64, 64, 32, 32, 1, 1, True, True, True, False),
    ("B1 64->64 s1 64^2 b+relu", 1, 64, 64, 64, 64, 1, 1, True, False, True, False),
    ("B1 64->64 s1 128^2 b+relu", 1, 64, 64, 128, 128, 1, 1, True, False, True, False),
    ("B1 64->64 s1 256^2 b+relu", 1, 64, 64, 256, 256, 1, 1, True, False, True, False),
    ("B1 64->64 s1 1024^2 b+r+relu", 1, 64, 64, 1024, 1024, 1, 1, True, True, True, False),
    ("B1 up2+64->64 64->128^2", 1, 64, 64, 64, 64, 1, 2, False, False, False, False),
    ("B1 64->3 s1 256^2 b", 1, 64, 3, 256, 256, 1, 1, True, False, False, False),
    # TAEHV taew2_2 decode at 704x1280 (frames of one chunk as batch): the memory blocks' convs per stage, the
    # last conv, and a TAESD-like 64->64 of the same pixel count as the 176x320 one (width vs size)
    ("TAEHV 128->64 176x320 B62 b+relu (memblock 1st)", 62, 128, 64, 176, 320, 1, 1, True, False, True, False),
    ("TAEHV 64->64 176x320 B62 b+r+relu", 62, 64, 64, 176, 320, 1, 1, True, True, True, False),
    ("TAEHV 256->128 88x160 B31 b+relu (memblock 1st)", 31, 256, 128, 88, 160, 1, 1, True, False, True, False),
    ("TAEHV 128->128 88x160 B31 b+r+relu", 31, 128, 128, 88, 160, 1, 1, True, True, True, False),
    ("TAEHV 256->256 44x80 B31 b+r+relu", 31, 256, 256, 44, 80, 1, 1, True, True, True, False),
    ("TAEHV 64->12 352x640 B124 b (last conv)", 124, 64, 12, 352, 640, 1, 1, True, False, False, False),
    ("64->64 s1 256^2 B54 b+r+relu (px of B62 176x320)", 54, 64, 64, 256, 256, 1, 1, True, True, True, False),
    # TAEHV streaming step (one latent frame): taew2_2 at 704x1280, then taew2_1 at 320x512; stages 0 and 1 run
    # one frame, so their grids hold a few dozen 128-pixel tiles
    ("STEP w22 clamp+48->256 44x80 B1 b+relu", 1, 48, 256, 44, 80, 1, 1, True, False, True, True),
    ("STEP w22 256->256 44x80 B1 b+r+relu", 1, 256, 256, 44, 80, 1, 1, True, True, True, False),
    ("STEP w22 256->256 44x80 B1 b+relu", 1, 256, 256, 44, 80, 1, 1, True, False, True, False),
    ("STEP w22 up2+256->128 44x80 B1", 1, 256, 128, 44, 80, 1, 2, False, False, False, False),
    ("STEP w22 128->128 88x160 B1 b+r+relu", 1, 128, 128, 88, 160, 1, 1, True, True, True, False),
    ("STEP w22 128->128 88x160 B1 b+relu", 1, 128, 128, 88, 160, 1, 1, True, False, True, False),
    ("STEP w22 up2+128->64 88x160 B2", 2, 128, 64, 88, 160, 1, 2, False, False, False, False),
    ("STEP w22 64->64 176x320 B2 b+r+relu", 2, 64, 64, 176, 320, 1, 1, True, True, True, False),
    ("STEP w22 up2+64->64 176x320 B4 relu", 4, 64, 64, 176, 320, 1, 2, False, False, True, False),
    ("STEP w22 64->12 352x640 B4 b", 4, 64, 12, 352, 640, 1, 1, True, False, False, False),
    ("STEP w21 256->256 40x64 B1 b+r+relu", 1, 256, 256, 40, 64, 1, 1, True, True, True, False),
    ("STEP w21 up2+256->128 40x64 B1", 1, 256, 128, 40, 64, 1, 2, False, False, False, False),
    ("STEP w21 128->128 80x128 B1 b+r+relu", 1, 128, 128, 80, 128, 1, 1, True, True, True, False),
    ("STEP w21 up2+128->64 80x128 B2", 2, 128, 64, 80, 128, 1, 2, False, False, False, False),
    ("STEP w21 64->64 160x256 B2 b+r+relu", 2, 64, 64, 160, 256, 1, 1, True, True, True, False),
    ("STEP w21 up2+64->64 160x256 B4 relu", 4, 64, 64, 160, 256, 1, 2, False, False, True, False),
    ("STEP w21 64->3 320x512 B4 b", 4, 64, 3, 320, 512, 1, 1, True, False, False, False),
]

# The configs the Triton rows take (row default first, then these where they differ and the kernel accepts them).
TC_SWEEP = [triton_conv.TCConfig(64, 4, 3), triton_conv.TCConfig(128, 4, 3), triton_conv.TCConfig(128, 8, 3),
            triton_conv.TCConfig(256, 8, 3), triton_conv.TCConfig(128, 4, 2), triton_conv.TCConfig(128, 4, 3, cache_a=True),
            triton_conv.TCConfig(64, 4, 2), triton_conv.TCConfig(32, 4, 3)]
TMA_SWEEP = [triton_conv_tma.TMAConfig(128, 4, 3, 16), triton_conv_tma.TMAConfig(128, 4, 3, 32),
             triton_conv_tma.TMAConfig(128, 4, 4, 16), triton_conv_tma.TMAConfig(256, 8, 3, 16),
             triton_conv_tma.TMAConfig(128, 8, 3, 16), triton_conv_tma.TMAConfig(64, 4, 3, 8),
             triton_conv_tma.TMAConfig(128, 4, 3, 16, persistent=1), triton_conv_tma.TMAConfig(128, 4, 3, 16, persistent=2),
             # output channels over more programs (small grids: the step's one-frame stages)
             triton_conv_tma.TMAConfig(128, 4, 3, 16, block_n=64), triton_conv_tma.TMAConfig(128, 4, 4, 16, block_n=64),
             triton_conv_tma.TMAConfig(64, 4, 3, 8, block_n=64), triton_conv_tma.TMAConfig(64, 4, 4, 16, block_n=64),
             triton_conv_tma.TMAConfig(64, 4, 4, 8), triton_conv_tma.TMAConfig(64, 4, 2, 16)]


def gpu_ms(fn) -> float:
    """Median ms of CUDA-graph replays of fn (a plain capture: these calls do not go through the dispatcher)."""
    return time_ms(graphed(fn))


def sweeps(row_name: str, args: tuple) -> list:
    """(label, launch) for each extra config of a Triton row, the row's default config first."""
    x, w, b, stride, r, relu, up, clamp = args
    if row_name == "triton_conv":
        B, c_in, H, W = x.shape
        _, _, Ho, Wo = conv_contract.output_shape(x.shape, w.shape, stride, up)
        default = triton_conv.default_config(c_in, w.shape[0], stride, up, B * (H * W if up == 2 else Ho * Wo))
        launch = triton_conv.conv3x3_tc_launch
        configs = [default] + [c for c in TC_SWEEP if c != default]
    elif row_name == "triton_conv_tma":
        default = triton_conv_tma.shape_config(w.shape[0], x.shape, up, x.device)
        launch = triton_conv_tma.conv3x3_tma_launch
        configs = [default] + [c for c in TMA_SWEEP if c != default]
    else:
        return []
    return [(f"{row_name} {c}" + (" (default)" if i == 0 else ""),
             lambda c=c: launch(x, w, b, r, stride, relu, up, clamp, config=c)) for i, c in enumerate(configs)]


def measured(label: str, fn, ref: torch.Tensor, torch_err: float, base: float) -> dict:
    """One kernel: a poisoned run checked against the float64 reference, then its graph-replay time."""
    with poisoned():
        y = fn()
    torch.cuda.synchronize()
    err, status = verdict(y, ref, torch_err)
    del y
    ms = gpu_ms(fn)
    return {"impl": label, "ms": ms, "vs cudnn": base / ms, "err": err, "ok": status}


def bench_shape(spec, budget_end: float, quick: bool) -> list[dict]:
    name, B, cin, cout, H, W, stride, up, bias, res, relu, pre_clamp = spec
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(B, cin, H, W, device="cuda", generator=g).half().contiguous(memory_format=CL)
    w = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (3 * cin**0.5)).half()
    b = (torch.randn(cout, device="cuda", generator=g) * 0.5).half() if bias else None
    oshape = conv_contract.output_shape(x.shape, w.shape, stride, up)
    r = torch.randn(oshape, device="cuda", generator=g).half().contiguous(memory_format=CL) if res else None
    nchw = lambda t: None if t is None else t.contiguous()
    cl_args = (x, w, b, stride, r, relu, up, pre_clamp)  # the dispatcher's conv2d signature
    nchw_args = (nchw(x), w, b, stride, nchw(r), relu, up, pre_clamp)
    flop = triton_conv.flops(x.shape, w.shape, stride, up)
    n_out = torch.Size(oshape).numel()
    floor = 2 * (x.numel() + n_out * (2 if res else 1)) / (HBM_TBS * 1e12) * 1e3  # f16 x, y and residual

    ref = conv_contract.conv3x3_math(x, w, b, r, stride, relu, up, pre_clamp, dtype=torch.float64)
    rows = []
    errs, times = {}, {}
    for layout, args in (("cl", cl_args), ("nchw", nchw_args)):
        errs[layout] = rel_err(torch_ops.conv2d(*args), ref)
        times[layout] = gpu_ms(lambda args=args: torch_ops.conv2d(*args))
    torch_err, base = errs["cl"], times["cl"]  # the bound and the yardstick: the model's channels_last path
    rows += [{"impl": f"cudnn model ops {layout}", "ms": times[layout], "vs cudnn": base / times[layout],
              "err": errs[layout]} for layout in ("cl", "nchw")]
    for layout, xx in (("cl", x), ("nchw", nchw(x))):
        conv = (lambda xx=xx: F.conv2d(xx, w, b, stride=stride, padding=1)) if up == 1 else (
            lambda xx=xx: F.conv2d(F.interpolate(xx, scale_factor=2.0, mode="nearest"), w, b, padding=1))
        ms = gpu_ms(conv)
        rows.append({"impl": f"cudnn conv {layout}" if up == 1 else f"cudnn interp+conv {layout}", "ms": ms,
                     "vs cudnn": base / ms})

    for row in kernel_rows.KERNEL_ROWS:
        if row.kind != "conv2d":
            continue
        native = "channels_last" if "channels_last" in row.layouts else "nchw"
        rspec = kernel_spec(x, w, b, stride, r, relu, up, pre_clamp, native)
        why = row.supports(rspec)
        if why is not None:
            rows.append({"impl": row.name, "note": f"refused: {why}"})
            continue
        args = cl_args if native == "channels_last" else nchw_args
        runs = [(row.name, lambda row=row, args=args: row.run(*args))]
        if not quick:
            runs += sweeps(row.name, cl_args)[1:]  # the default config is the row's run itself
        for i, (label, fn) in enumerate(runs):
            if i > 0 and time.time() > budget_end:
                rows.append({"impl": label, "note": "skipped (time budget)"})
                continue
            try:
                entry = measured(label, fn, ref, torch_err, base)
                if i == 0:
                    entry["eager ms"] = time_ms(fn)
                rows.append(entry)
            except Exception as e:  # noqa: BLE001 - one failing kernel or config must not stop the table
                torch.cuda.synchronize()
                rows.append({"impl": label, "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}"})
    for entry in rows:
        ms = entry.get("ms")
        entry.update({"TFLOP/s": flop / ms / 1e9 if ms else None, "floor ms": floor})
    return [{"shape": name, **entry} for entry in rows]  # the tensors die with this frame


def kernel_spec(x, w, b, stride, r, relu, up, pre_clamp, layout: str) -> Spec:
    """The dispatcher's Spec of this call, as a row's support rule is asked."""
    return Spec("conv2d", str(x.device), tuple(x.shape), tuple(w.shape), x.dtype, stride, b is not None,
                r is not None, relu, layout, up, pre_clamp)


def fmt(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    table = [keys] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(t, widths)).rstrip() for t in table)


def best_line(name: str, shape_rows: list[dict]) -> str | None:
    good = [r for r in shape_rows if r.get("ok") == "ok"]
    if not good:
        return None
    top = min(good, key=lambda r: r["ms"])
    base = next(r for r in shape_rows if r["impl"] == "cudnn model ops cl")
    return (f"{name:42s} best {top['impl']:40s} {top['ms']:.4g} ms  {top['vs cudnn']:.2f}x vs cudnn model ops cl"
            f" ({base['ms']:.4g} ms), floor {top['floor ms']:.3g} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="file to write the report to")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping configs after this many seconds")
    ap.add_argument("--quick", action="store_true", help="every row at its default, no config sweeps")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run (default all)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not triton_conv.triton_available("cuda"):
        sys.exit(f"needs CUDA and Triton: {triton_conv.triton_unavailable_reason('cuda')}")
    import triton

    torch.backends.cudnn.benchmark = True
    t0 = time.time()
    head = (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"cuDNN {torch.backends.cudnn.version()}")
    print(head, flush=True)
    wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, best, summary = [], [], "no shape matched --shapes"
    for spec in SHAPES:
        if wanted and not any(wd in spec[0] for wd in wanted):
            continue
        try:
            shape_rows = bench_shape(spec, t0 + args.budget_s, args.quick)
        except Exception as e:  # noqa: BLE001 - e.g. OOM on a smaller GPU: report and go on
            shape_rows = [{"shape": spec[0], "impl": "-", "note": f"failed: {type(e).__name__}: {str(e)[:100]}"}]
        torch.cuda.empty_cache()
        rows += shape_rows
        print(fmt(shape_rows), flush=True)
        line = best_line(spec[0], shape_rows)
        if line:
            best.append(line)
        summary = "\n".join(["best config per shape:", *best, f"total {time.time() - t0:.0f} s"])
        out.write_text("\n".join([head, "", fmt(rows), "", summary]) + "\n")
    print("\n" + summary, flush=True)


if __name__ == "__main__":
    main()
