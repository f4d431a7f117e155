#!/usr/bin/env python3
r"""Per-layer-group profile of a TAEHV `decode_video`: where the time goes, against the hardware's floors.

    python3 tools/profile_taehv.py [--variant taew2_2] [--latents 31] [--size 704x1280] [--runs 7] [--kernels 20]
    python3 tools/profile_taehv.py --step [--uint8] [--variant taew2_1 --size 320x512] --kernels 30
    python3 tools/profile_taehv.py --device cpu --small     (a smoke test: a tiny clip in fp32 on the CPU)

Each layer group of the decoder (the first conv, each stage's memory blocks, TGrow's 1x1 conv, the upsample + 3x3
conv, the last conv) is timed inside the user's call (`model.decode_video(latents)`, chunks and all) with CUDA
events recorded by forward hooks, summed over its calls, median of --runs runs after a warm-up; what no group
covers (the memory blocks' past frames, the pixel shuffle, clamp and output writes) is the row "other". The
markdown table gives each group's ms, share, achieved TFLOP/s and GB/s, its FLOPs (counted by
torch.utils.flop_counter on the PyTorch path: 2 x multiply-adds of every conv) and bytes (each call's input, output
and weight tensors once: what a fused group must move at least), and its floors at --peak-tflops (790: an H200's
dense fp16) and --peak-gbs (4800). The decode without hooks is timed too (the events add a little). The model has
random weights in the published layout (the time does not depend on them). --kernels N adds a second table: the
N costliest kernels of one call as the user runs it (a whole-call CUDA-graph replay), by torch.profiler, which sees
the copies and glue no group owns. --step profiles the streaming step instead: `decode_step` of one latent frame on
a stream already under way (a replay of the step's graph where the table says replay), --uint8 with uint8 frames.
With $OUT set, the tables go there as profile_taehv_<variant>[_step].md. With kernels, TGrow is folded into
the conv after it (models/taehv/layers.py `grow_conv`) wherever the fold applies, and neither module's forward
runs: such a call is timed as a whole into the conv's group, whose label then says so, and the TGrow group has no
time of its own (its FLOPs and bytes, counted on the PyTorch path, stay in its row).

--ncu-window skips the tables: after the same warm-up it runs one call (a graph replay) between
cudaProfilerStart and cudaProfilerStop, for Nsight Compute to profile kernel by kernel. To redo BENCHMARKS.md's ncu
table of the step (taken with these ncu options around the same window):
    ncu --clock-control none --profile-from-start off --graph-profiling node --target-processes application-only \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
        python3 tools/profile_taehv.py --step --uint8 --variant taew2_1 --size 320x512 --ncu-window
Run the same command once without ncu first, with the same TAESD_FAST_CACHE_DIR: tuning that runs under ncu times
the rows inside the profiled process and has picked other rows than a user's step runs (BENCHMARKS.md,
"Fifteenth session").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taesd_fast import dispatch
from taesd_fast.apps.bench.taehv import random_decoder
from taesd_fast.models.layers import DispatchConv2d
from taesd_fast.models.taehv import layers as taehv_layers
from taesd_fast.models.taehv import sequence
from taesd_fast.models.taehv.layers import MemBlock, SuperMemBlock, TGrow

SMALL = dict(latents=3, size=(32, 48))  # --small: pixels (for patch 1; scaled by the patch size)
FOLDED = " (TGrow folded in where the fold applies)"  # the label of a conv after TGrow


def group_units(decoder: nn.Sequential) -> dict[nn.Module, str]:
    """Each timed unit of the decoder -> its group's label: the first and last conv, each stage's memory blocks,
    TGrow's 1x1 conv, the conv after the upsample (or before the super decoder's pixel shuffle)."""
    units: dict[nn.Module, str] = {}
    modules = list(decoder)
    convs = [m for m in modules if isinstance(m, DispatchConv2d)]
    stage = 0
    for i, m in enumerate(modules):
        if isinstance(m, (MemBlock, SuperMemBlock)):
            units[m] = f"stage {stage} {type(m).__name__}s ({m.conv[-1].out_channels} ch)"
        elif isinstance(m, TGrow):
            units[m] = f"stage {stage} TGrow 1x1 (x{m.stride} time)"
            stage += 1
        elif isinstance(m, DispatchConv2d):
            if m is convs[0]:
                units[m] = f"first conv ({m.in_channels} -> {m.out_channels})"
            elif m is convs[-1]:
                units[m] = f"last conv ({m.in_channels} -> {m.out_channels})"
            elif i > 0 and isinstance(modules[i - 1], TGrow):
                units[m] = f"stage {stage - 1} upsample + conv 3x3 ({m.in_channels} -> {m.out_channels}){FOLDED}"
            else:  # the super decoder's conv before its pixel shuffle
                units[m] = f"stage {stage} conv 3x3 + pixel shuffle ({m.in_channels} -> {m.out_channels})"
    return units


class Recorder:
    """Forward hooks on the units: start/end marks per call (CUDA events, or the clock on the CPU), and in a
    counting pass FLOPs (FlopCounterMode over the call) and bytes (input, output and weight tensors). The TGrow fold
    (`grow_conv`, which runs neither TGrow's nor the conv's forward where it folds) is timed as one call of the conv's
    unit, with the modules' hooks quiet inside it, while the recorder is installed (until `remove`)."""

    def __init__(self, units: dict[nn.Module, str], cuda: bool):
        self.units, self.cuda = units, cuda
        self.marks: list[tuple[str, object, object]] = []
        self.counting = False
        self.flops: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.shape: dict[str, str] = {}
        self._open: dict[nn.Module, object] = {}
        self._quiet = False
        self.handles = []
        for module in units:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        self._grow_conv = sequence.grow_conv
        sequence.grow_conv = self._timed_grow_conv

    def _timed_grow_conv(self, grow, conv, x, *args, **kwargs):
        if self.counting or conv not in self.units or not taehv_layers._foldable(x, grow, conv):
            return self._grow_conv(grow, conv, x, *args, **kwargs)  # the modules' own hooks see it
        self._quiet = True
        start = self._now()
        try:
            out = self._grow_conv(grow, conv, x, *args, **kwargs)
        finally:
            self._quiet = False
        self.marks.append((self.units[conv], start, self._now()))
        return out

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        if self._quiet:
            return
        if self.counting:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            counter.__enter__()
            self._open[module] = counter
        else:
            self._open[module] = self._now()

    def _post(self, module, args, kwargs, output):
        if self._quiet:
            return
        label = self.units[module]
        if not self.counting:
            self.marks.append((label, self._open.pop(module), self._now()))
            return
        counter = self._open.pop(module)
        counter.__exit__(None, None, None)
        tensors = [t for t in (*args, *kwargs.values(), output, *module.parameters()) if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.flops[label] = self.flops.get(label, 0) + counter.get_total_flops()
        self.bytes[label] = self.bytes.get(label, 0) + sum(seen.values())
        self.calls[label] = self.calls.get(label, 0) + 1
        self.shape.setdefault(label, "x".join(map(str, args[0].shape[-2:])))

    def times(self) -> dict[str, float]:
        """ms per group in the marks so far (then cleared)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for label, start, end in self.marks:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            out[label] = out.get(label, 0.0) + ms
        self.marks.clear()
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if sequence.grow_conv == self._timed_grow_conv:
            sequence.grow_conv = self._grow_conv


def wall_ms(fn, cuda: bool) -> float:
    """ms of one fn() call (CUDA events around it, or the clock)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def back_to_back(fn, cuda: bool, calls: int = 20) -> tuple[float, float]:
    """(ms per call of `calls` calls issued back to back, the host's ms per call to issue them): where the host's
    ms is below the first, the GPU's work sets the pace of a stream of calls."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    if not cuda:
        return host, host
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, host


def kernel_rows(call, cuda: bool, top: int) -> list[str]:
    """Markdown rows of where one call's time goes by kernel (torch.profiler, which adds a little time): on CUDA the
    GPU kernels' own times, those inside a CUDA-graph replay included, summed by kernel name; on the CPU the
    operators' self times. The `top` largest, then the rest in one row."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += (event.device_time if cuda else event.self_cpu_time_total) / 1e3
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    whole = sum(ms for ms, _ in totals.values()) or 1.0
    rest = ranked[top:]
    if rest:
        ranked = ranked[:top] + [(f"({len(rest)} others)", [sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)])]
    lines = [f"{'GPU kernels' if cuda else 'CPU operators'} of one call (torch.profiler): {whole:.3f} ms in all", "",
             "| kernel | calls | ms | share |", "|---|---|---|---|"]
    lines += [f"| `{name[:100]}` | {n} | {ms:.3f} | {100 * ms / whole:.1f}% |" for name, (ms, n) in ranked]
    return lines


def profile(variant: str, latents: int, size: tuple[int, int], device: str, dtype: torch.dtype, runs: int,
            backend: str, peak_tflops: float, peak_gbs: float, kernels: int = 0, step: bool = False,
            uint8: bool = False, layers: bool = False, ncu_window: bool = False) -> str:
    """The markdown report (header lines and the table) of one decode_video profile (with `step`, of one
    decode_step of one latent frame, uint8 frames with `uint8`); with `kernels`, also the table of the kernels
    one call (a replay, on CUDA) runs, the `kernels` largest by time; with `layers`, the dispatcher's table (the
    row each conv ran and the timings that chose it). With `ncu_window`, no tables: after the warm-up, one replayed
    call between cudaProfilerStart/Stop, and a line saying so."""
    cuda = device.startswith("cuda")
    model = random_decoder(variant).to(device=device, dtype=dtype)
    side = model.space_upscale
    if size[0] % side or size[1] % side:
        raise SystemExit(f"error: --size {size[0]}x{size[1]} is not a multiple of {variant}'s {side} pixels per "
                         f"latent cell")
    latents = 1 if step else latents
    z = torch.randn(1, latents, model.latent_channels, size[0] // side, size[1] // side, device=device, dtype=dtype)
    model.cuda_graphs = False  # the hooks' events time eager calls (a replay runs no hooks); replays timed below
    units = group_units(model.decoder)
    rec = Recorder(units, cuda)
    stream = {"state": None}

    def decode() -> torch.Tensor:  # the user's call
        if not step:
            return model.decode_video(z)
        frames, stream["state"] = model.decode_step(z, stream["state"], uint8=uint8)
        return frames

    with torch.no_grad(), dispatch.backend(backend), contextlib.ExitStack() as after_warmup:
        with dispatch.tuning("blocking"):
            decode()
            out = decode()  # warm-up: tuning, cuDNN choices, the allocator (a step: past the first step's trim)
            # The replayed call is decided from timings taken as graph replays (dispatch.graph_timing): the
            # captures must happen here too, or the replay would run the untuned PyTorch rows.
            model.cuda_graphs = True
            for _ in range(4):  # eager, capture, and a recapture where the capture's tuning changed decisions
                decode()
            model.cuda_graphs = False
        # What the warm-up did not tune must not start a tuning process in the middle of the measurement.
        after_warmup.enter_context(dispatch.tuning("off"))
        if ncu_window:  # one replayed call, alone between the profiler marks
            model.cuda_graphs = True
            decode(), decode()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            decode()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            return f"{variant}: one {'decode_step' if step else 'decode_video'} replay ran between cudaProfilerStart/Stop"
        rec.marks.clear()
        runs_ms = []
        for _ in range(runs):
            decode()
            runs_ms.append(rec.times())
        rec.remove()
        plain = statistics.median(wall_ms(decode, cuda) for _ in range(runs))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            decode()
            peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
        hooked = statistics.median(sum(r.values()) for r in runs_ms)
        model.cuda_graphs = True
        decode(), decode()  # the graph captured above replays
        replayed = statistics.median(wall_ms(decode, cuda) for _ in range(runs))
        streamed, host = back_to_back(decode, cuda)
        by_kernel = kernel_rows(decode, cuda, kernels) if kernels else []
        model.cuda_graphs = False
        rec = Recorder(units, cuda)
        rec.counting = True
        with dispatch.backend("torch"):  # FLOPs counted on the aten convs of the PyTorch path
            decode()
        rec.remove()
    groups = {label: statistics.median(r.get(label, 0.0) for r in runs_ms) for label in dict.fromkeys(units.values())}
    groups["other (past frames, pixel shuffle, clamp, output)"] = max(0.0, plain - sum(groups.values()))
    rec.bytes["other (past frames, pixel shuffle, clamp, output)"] = out.numel() * out.element_size()
    if step:
        call = f"decode_step{' (uint8)' if uint8 else ''}: 1 latent frame -> {tuple(out.shape[1:])}"
        chunk = "one step"
    else:
        outer, inner, _ = model._decode_chunks(latents, z.shape[-2], z.shape[-1], next(model.decoder.parameters()))
        call = f"decode_video: {latents} latent frames -> {tuple(out.shape[1:])}"
        chunk = f"chunks of {outer} latent frames, then the last stage {inner} frames"
    lines = [f"TAEHV {variant} {call} "
             f"({str(dtype).replace('torch.', '')}, {device}, backend {backend}, {chunk}); "
             f"{plain:.3f} ms per eager call (median of {runs}), {hooked:.3f} ms with the hooks' events, "
             f"{replayed:.3f} ms as a CUDA-graph replay (cuda_graphs, the default; {streamed:.3f} ms per call back "
             f"to back, the host {host:.3f} ms per call)"
             + (f"; peak {peak_gb:.2f} GB beyond the model and latents" if cuda else ""),
             f"floors: {peak_tflops:g} TFLOP/s, {peak_gbs:g} GB/s", "",
             "| group | input HxW | calls | ms | share | TFLOP/s | GB/s | GFLOP | MB | FLOP floor ms | bytes floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    total_flop = total_bytes = 0
    for label, ms in groups.items():
        flop, nbytes = rec.flops.get(label, 0), rec.bytes.get(label, 0)
        total_flop, total_bytes = total_flop + flop, total_bytes + nbytes
        lines.append(_row(label, rec.shape.get(label, ""), rec.calls.get(label, ""), ms, plain, flop, nbytes,
                          peak_tflops, peak_gbs))
    lines.append(_row("**total**", "", sum(rec.calls.values()), plain, plain, total_flop, total_bytes, peak_tflops,
                      peak_gbs))
    return "\n".join(lines + ([""] + by_kernel if by_kernel else []) + (["", model.dispatch_table()] if layers else []))


def _row(label, res, calls, ms, total_ms, flop, nbytes, peak_tflops, peak_gbs) -> str:
    """One table row; rates are left blank where no time was measured."""
    secs = ms / 1e3
    rates = f"{flop / secs / 1e12:.1f} | {nbytes / secs / 1e9:.0f}" if secs > 0 else " | "
    return (f"| {label} | {res} | {calls} | {ms:.3f} | {100 * ms / total_ms:.1f}% | {rates} | {flop / 1e9:.4g} | "
            f"{nbytes / 1e6:.4g} | {flop / (peak_tflops * 1e12) * 1e3:.3f} | {nbytes / (peak_gbs * 1e9) * 1e3:.3f} |")


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size takes HEIGHTxWIDTH in pixels (e.g. 704x1280), got {text!r}")
    return h, w


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="taew2_2")
    ap.add_argument("--latents", type=int, default=31, help="latent frames (31 -> 121 frames for taew2_2)")
    ap.add_argument("--size", type=_size, default=(704, 1280), help="output HEIGHTxWIDTH in pixels")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                    help="default: float16 on CUDA, float32 on the CPU")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--backend", default="auto", help="the dispatcher's backend (auto, torch, kernels)")
    ap.add_argument("--small", action="store_true", help="a tiny clip (3 latent frames, 32x48 per patch)")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--peak-gbs", type=float, default=4800.0)
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list the N costliest kernels of one call (a whole-call replay on CUDA), by name")
    ap.add_argument("--step", action="store_true", help="profile decode_step of one latent frame, not decode_video")
    ap.add_argument("--uint8", action="store_true", help="with --step: uint8 frames")
    ap.add_argument("--table", action="store_true", help="also the dispatcher's per-layer table")
    ap.add_argument("--ncu-window", action="store_true",
                    help="no tables: one replayed call between cudaProfilerStart/Stop, for ncu --profile-from-start off")
    args = ap.parse_args(argv)
    if args.uint8 and not args.step:
        ap.error("--uint8 goes with --step (decode_video returns float frames)")
    if args.ncu_window and not args.device.startswith("cuda"):
        ap.error(f"--ncu-window needs a CUDA device (Nsight Compute profiles GPU kernels), got --device {args.device}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device} but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    dtype = getattr(torch, args.dtype or ("float16" if args.device.startswith("cuda") else "float32"))
    latents, size = args.latents, args.size
    if args.small:
        from taesd_fast.models.taehv.hub import VARIANTS

        p = VARIANTS[args.variant].patch_size
        latents, size = SMALL["latents"], (SMALL["size"][0] * p, SMALL["size"][1] * p)
    report = profile(args.variant, latents, size, args.device, dtype, args.runs, args.backend, args.peak_tflops,
                     args.peak_gbs, args.kernels, args.step, args.uint8, args.table, args.ncu_window)
    print(report, flush=True)
    if os.environ.get("OUT") and not args.ncu_window:
        path = Path(os.environ["OUT"]) / f"profile_taehv_{args.variant}{'_step' if args.step else ''}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report + "\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
