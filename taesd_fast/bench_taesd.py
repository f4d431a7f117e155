"""Benchmark section: whole TAESD encode/decode against the PyTorch baselines of ANCHORS.md, in one run.

Rows: eager NCHW, eager channels_last, channels_last + CUDA graph, torch.compile (default and, for the
workloads listed in MAX_AUTOTUNE, max-autotune), and taesd_fast in auto mode (eager, and in a CUDA graph).
Random weights with the TAESD architecture (speed does not depend on the values); random inputs, never zeros.
"""

from __future__ import annotations

import copy
import statistics

import torch

# (name, part, batch, height, width): height/width are image pixels.
WORKLOADS = [
    ("decode 256² B=1", "decoder", 1, 256, 256),
    ("decode 256² B=16", "decoder", 16, 256, 256),
    ("decode 256² B=64", "decoder", 64, 256, 256),
    ("decode 512² B=1", "decoder", 1, 512, 512),
    ("decode 1024² B=1", "decoder", 1, 1024, 1024),
    ("encode 256² B=16", "encoder", 16, 256, 256),
    ("encode 512² B=1", "encoder", 1, 512, 512),
]
# max-autotune compiles for minutes per shape: only where ANCHORS.md has a figure to compare with.
MAX_AUTOTUNE = {"decode 256² B=1", "decode 256² B=64", "decode 1024² B=1"}


def time_ms(fn, reps: int = 5, inner: int = 10) -> float:
    """Median over `reps` loops of `inner` calls, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def graphed(fn, example: torch.Tensor):
    """Capture fn(example) in a CUDA graph; the returned callable replays it on the captured input buffer."""
    static_in = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up on a side stream, as CUDA graph capture requires
            fn(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static_in)
    return graph.replay


def _inputs(model, part: str, batch: int, h: int, w: int) -> torch.Tensor:
    if part == "decoder":
        f = model.downscale
        return torch.randn(batch, model.latent_channels, h // f, w // f, device="cuda", dtype=torch.float16)
    return torch.rand(batch, 3, h, w, device="cuda", dtype=torch.float16)


def bench_taesd(variant: str = "taesd", workloads=None, compile_modes=("default", "max-autotune")) -> list[dict]:
    """Rows of {workload, method, ms, vs_compile} for each workload and method."""
    from . import backend
    from .taesd import TAESD

    torch.backends.cudnn.benchmark = True
    model = TAESD(variant).cuda().half().eval()
    rows = []
    for name, part, batch, h, w in workloads or WORKLOADS:
        x = _inputs(model, part, batch, h, w)
        api = model.decode if part == "decoder" else model.encode
        plain = getattr(model, part)
        # Baselines use a plain nn.Sequential copy run through PyTorch only, as users run TAESD today.
        cl = copy.deepcopy(plain).to(memory_format=torch.channels_last)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        methods = {}
        with torch.no_grad(), backend("torch"):
            methods["eager NCHW"] = lambda: plain(x)
            methods["eager channels_last"] = lambda: cl(x_cl)
            times = {k: time_ms(f) for k, f in methods.items()}
            times["channels_last + CUDA graph"] = time_ms(graphed(cl, x_cl))
            for mode in compile_modes:
                if mode == "max-autotune" and name not in MAX_AUTOTUNE:
                    continue
                torch._dynamo.reset()
                compiled = torch.compile(copy.deepcopy(cl), mode=mode)
                times[f"torch.compile {mode}"] = time_ms(lambda: compiled(x_cl))
        with torch.no_grad(), backend("auto"):
            api(x)  # first call measures and records the per-layer choices
            times["taesd_fast auto"] = time_ms(lambda: api(x))
            times["taesd_fast auto + CUDA graph"] = time_ms(graphed(api, x))
        best_compile = min((t for k, t in times.items() if k.startswith("torch.compile")), default=None)
        for method, ms in times.items():
            rows.append({
                "workload": name, "method": method, "ms": ms,
                "fps": batch * 1000.0 / ms,
                "vs_compile": (best_compile / ms) if best_compile else None,
            })
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| workload | method | ms | frames/s | speed vs best torch.compile |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_compile']:.2f}x" if r["vs_compile"] else "—"
        lines.append(f"| {r['workload']} | {r['method']} | {r['ms']:.3f} | {r['fps']:.0f} | {ratio} |")
    return "\n".join(lines)
