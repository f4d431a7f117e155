#!/usr/bin/env python3
"""Upstream TAEHV (madebyollin/taehv's taehv.py, from the user's path) beside taesd_fast, in one process.

    python3 tools/bench_upstream_taehv.py PATH/TO/taehv.py [--workloads taew2_2-121,taew2_1-61,taew2_2-13]
        [--no-compile] [--no-encode] [--only TEXT,...] [--device cuda] [--small] [--table]

Upstream's file is imported from the given path (it is MIT-licensed and stays the user's: nothing of it is copied
here). Both models get the same random weights: taesd_fast's model in the published layout is saved as
<variant>.pth, which upstream's `TAEHV(checkpoint_path=...)` loads (its file-name rule picks the patch size and
latent channels; its strict load_state_dict checks the layout). Rows, each the user's call:
  upstream eager            `upstream.decode_video(z, parallel=True, show_progress_bar=False)`
  upstream channels_last    the same with channels_last weights
  upstream torch.compile    `torch.compile(upstream.decode_video, mode="max-autotune")`, channels_last weights
  taesd_fast decode_video   `model.decode_video(z)` (from its second call a CUDA-graph replay of the whole call)
  ..., no graphs            the same with `model.cuda_graphs = False`: every call launches its kernels
  ..., PyTorch rows         the same with `dispatch.backend("torch")`: our model without our kernels (replayed)
and, with encoding on, upstream's `encode_video(video)` and taesd_fast's `encode_video(video)` on the clip's
frames. taesd_fast's rows are measured once its tuning (default: the tuning process) has put its choices in effect
and a call sends it nothing new (`settled`). Each row: ms (median after warm-up); host ms (how long the call takes
to return on an idle GPU, unsynchronized: near ms means CPU-bound); peak GB (torch.cuda.max_memory_allocated over
the timed calls); the max abs / relative error against upstream's eager decode (or encode) in fp32 (TF32 off).
Workloads (fp16 on CUDA, batch 1): taew2_2-121 (31 latents 44x80 -> 121 frames 704x1280), taew2_1-61 (16 latents
40x64 -> 61 frames 320x512), taew2_2-13 (4 latents 44x80 -> 13 frames). --small: 3 latents of 2x3 each (a smoke
test; fp32 on the CPU). --only: measure only the rows whose method contains one of the given texts (e.g.
"encode" for the encode rows; the references are computed all the same). --table: after each workload, the dispatcher's per-layer table (the row each layer ran and
the timings it was chosen by). The table goes to stdout and, with $OUT set, to $OUT/upstream_taehv.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import dispatch
from taesd_fast.apps.bench.taehv import errors, random_decoder
from taesd_fast.models.taehv.model import TAEHV


class Workload(NamedTuple):
    name: str
    variant: str
    latents: int
    height: int  # latent cells
    width: int


WORKLOADS = {w.name: w for w in (Workload("taew2_2-121", "taew2_2", 31, 44, 80),
                                 Workload("taew2_1-61", "taew2_1", 16, 40, 64),
                                 Workload("taew2_2-13", "taew2_2", 4, 44, 80))}
COLUMNS = ("workload", "method", "ms", "host ms", "peak GB", "max abs err", "rel err", "note")


def load_upstream(path: str) -> types.ModuleType:
    """Upstream's taehv.py as a module, imported from the user's file. Upstream imports tqdm for progress bars
    (never shown here); where tqdm is not installed a pass-through stands in."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"error: {path} is not a file; pass the path of upstream's taehv.py (madebyollin/taehv)")
    try:
        import tqdm.auto  # noqa: F401
    except ImportError:
        stub = types.ModuleType("tqdm.auto")
        stub.tqdm = lambda items=None, *args, **kwargs: items
        sys.modules.setdefault("tqdm", types.ModuleType("tqdm"))
        sys.modules["tqdm.auto"] = stub
    spec = importlib.util.spec_from_file_location("upstream_taehv", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise SystemExit(f"error: importing {path} failed: {type(err).__name__}: {err}") from None
    if not hasattr(module, "TAEHV"):
        raise SystemExit(f"error: {path} has no TAEHV class; is it madebyollin/taehv's taehv.py?")
    return module


def upstream_model(module: types.ModuleType, ours: TAEHV, folder: Path):
    """Upstream's TAEHV with ours' weights: saved as <variant>.pth, whose name upstream reads the layout from."""
    path = folder / f"{ours.variant}.pth"
    torch.save({k: v.detach().float().cpu() for k, v in ours.state_dict().items()}, path)
    return module.TAEHV(checkpoint_path=str(path)).eval().requires_grad_(False)


def timed(fn, cuda: bool, runs: int = 5) -> tuple[float, float | None, float | None]:
    """(median ms per call after two warm-up calls, peak GB over the timed calls, host ms; None for the last two on
    the CPU). Host ms: how long the call takes to return on an idle GPU without a synchronize, the CPU's share. Where
    it is close to ms the GPU waits for launches (the call is CPU-bound)."""
    fn(), fn()
    if not cuda:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), None, None
    from taesd_fast.timing import time_ms

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(fn, reps=runs)
    peak = torch.cuda.max_memory_allocated() / 1e9
    host = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return ms, peak, statistics.median(host)


def on_torch(fn):
    """fn with every dispatched call on its PyTorch row: our model's structure without our kernels."""
    def call():
        with dispatch.backend("torch"):
            return fn()
    return call


def eager(model: TAEHV, fn):
    """fn with the model's whole-call CUDA graphs off: every call launches its kernels."""
    def call():
        model.cuda_graphs = False
        try:
            return fn()
        finally:
            model.cuda_graphs = True
    return call


def settled(fn, rounds: int = 6):
    """fn's output once a call sends the tuning process nothing new. A call whose layers switch to kernels can
    reach shapes (and layouts) the first call did not, whose jobs would otherwise be tuned on the GPU while the
    timed calls run."""
    out = None
    for _ in range(rounds):
        dispatch.wait_for_tuning(timeout=600)
        status = dispatch.tuning_status()
        sent = status.done + status.pending
        out = fn()
        status = dispatch.tuning_status()
        if status.done + status.pending == sent:
            break
    dispatch.wait_for_tuning(timeout=600)
    return out


def rows_for(module, work: Workload, device: str, dtype: torch.dtype, compile_mode: str | None, encode: bool,
             seed: int = 0, show_table: bool = False, only: tuple[str, ...] = ()) -> list[dict]:
    """The rows of one workload (each printed as it is measured)."""
    cuda = device.startswith("cuda")
    ours32 = random_decoder(work.variant, seed, encoder=True)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, work.latents, ours32.latent_channels, work.height, work.width, generator=gen)
    side = ours32.space_upscale
    video_frames = ours32.t_downscale * (work.latents - 1) + 1
    video = torch.rand(1, video_frames, 3, work.height * side, work.width * side, generator=gen)
    z, video = z.to(device, dtype), video.to(device, dtype)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        up = upstream_model(module, ours32, Path(folder))
    with torch.no_grad():
        saved_tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # an fp32 reference, not TF32
        try:
            up32 = copy.deepcopy(up).to(device)
            ref_dec = up32.decode_video(z.float(), parallel=True, show_progress_bar=False).cpu()
            ref_enc = up32.encode_video(video.float(), parallel=True, show_progress_bar=False).cpu() if encode else None
            del up32
        finally:
            torch.backends.cudnn.allow_tf32 = saved_tf32
        up16 = up.to(device, dtype)
        up_cl = copy.deepcopy(up16).to(memory_format=torch.channels_last)
        ours = ours32.to(device, dtype)
        methods = {
            "upstream eager": (lambda: up16.decode_video(z, parallel=True, show_progress_bar=False), ref_dec),
            "upstream channels_last": (lambda: up_cl.decode_video(z, parallel=True, show_progress_bar=False),
                                       ref_dec),
            "taesd_fast decode_video": (lambda: ours.decode_video(z), ref_dec),
            "taesd_fast decode_video, no graphs": (eager(ours, lambda: ours.decode_video(z)), ref_dec),
            "taesd_fast decode_video, PyTorch rows": (on_torch(lambda: ours.decode_video(z)), ref_dec),
        }
        if encode:
            methods["upstream eager encode_video"] = (
                lambda: up16.encode_video(video, parallel=True, show_progress_bar=False), ref_enc)
            methods["taesd_fast encode_video"] = (lambda: ours.encode_video(video), ref_enc)
            methods["taesd_fast encode_video, no graphs"] = (eager(ours, lambda: ours.encode_video(video)), ref_enc)
            methods["taesd_fast encode_video, PyTorch rows"] = (on_torch(lambda: ours.encode_video(video)), ref_enc)
        if compile_mode:
            compiled = torch.compile(up_cl.decode_video, mode=compile_mode)
            methods[f"upstream torch.compile {compile_mode}"] = (
                lambda: compiled(z, parallel=True, show_progress_bar=False), ref_dec)
        for method, (fn, ref) in methods.items():
            if only and not any(text in method for text in only):
                continue
            row = {"workload": work.name, "method": method}
            try:
                out = fn()
                if method.startswith("taesd_fast"):  # the steady state: what the tuning process chose, in effect
                    out = settled(fn)
                row["max abs err"], row["rel err"] = errors(out, ref)
                del out
                row["ms"], row["peak GB"], row["host ms"] = timed(fn, cuda)
            except Exception as err:  # a row that cannot run here (out of memory, no compiler) is reported
                text = str(err).strip().splitlines()
                row["note"] = f"failed: {type(err).__name__}" + (f": {text[0]}" if text else "")
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print("  " + " | ".join(_cell(row.get(k)) for k in COLUMNS), flush=True)
    if show_table:
        print(dispatch.dispatch_table(ours), flush=True)
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.3f}"
    return str(value)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("upstream", help="path of upstream's taehv.py (madebyollin/taehv)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile max-autotune rows")
    ap.add_argument("--no-encode", action="store_true", help="skip the encode_video rows")
    ap.add_argument("--only", default="", help="comma-separated texts: measure only the methods containing one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="3 latents of 2x3 per workload: a smoke test")
    ap.add_argument("--table", action="store_true", help="print the dispatcher's per-layer table after each workload")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise SystemExit(f"error: --workloads {args.workloads!r}: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device} but torch {torch.__version__} sees no CUDA GPU; "
                         f"use --device cpu")
    module = load_upstream(args.upstream)
    cuda = args.device.startswith("cuda")
    dtype = torch.float16 if cuda else torch.float32
    rows: list[dict] = []
    print("  " + " | ".join(COLUMNS), flush=True)
    for name in names:
        work = WORKLOADS[name]
        if args.small:
            work = work._replace(name=f"{work.name} (small: 3 latents 2x3)", latents=3, height=2, width=3)
        rows += rows_for(module, work, args.device, dtype, None if args.no_compile else "max-autotune",
                         not args.no_encode, show_table=args.table,
                         only=tuple(t.strip() for t in args.only.split(",") if t.strip()))
    report = (f"upstream {args.upstream} vs taesd_fast ({str(dtype).replace('torch.', '')}, {args.device}); "
              f"errors against upstream's fp32 eager output\n\n{table(rows)}")
    print(report, flush=True)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "upstream_taehv.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report + "\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
