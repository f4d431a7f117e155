"""First use as a new user meets it: the wall time of each decode call in a fresh process whose caches (taesd_fast's
timings, Triton's and Inductor's kernels) start empty, beside the torch backend's calls, and again in a second process
that reuses those caches.

    python tools/bench_first_use.py [--model taesd|taehv] [--serial] [--blocking] [--profile-first] [--keep DIR]

--model taesd (default): each measured process loads the bundled TAEF2 weights in float16 on CUDA and calls `decode`
three times for each of 256² B=1, 256² B=64 and 512² B=1, then for a shape it has not seen (256² B=4).
--model taehv: taew2_2 with random weights in the published layout (none are bundled), float16 on CUDA,
`decode_video` of 4 latent frames (13 frames at 704x1280), then `decode_step` of one latent frame on a stream, then
a clip it has not seen (7 latents, 25 frames). Every call is synchronized. --profile-first: cProfile over each
process's first call; its costliest functions (cumulative) go into the table. Then
it waits for subprocess tuning to finish (how long after its first call) and times the tuned calls (graph replays;
wall time per call and GPU time between CUDA events, apart to show host overhead);
it also records each tuning process's lifetime and its allocator's peak GPU memory, and each process's dispatch table
(the JSON's dispatch_table: compare the processes' decisions).
Processes: "torch" (set_backend("torch"), its own empty caches), "cold" (default settings, empty caches), "second"
(default settings, the caches "cold" left), with --serial "serial" (empty caches, the tuning process compiling
without its compile workers: TAESD_FAST_TUNING_COMPILERS=0) and with --blocking "blocking" (TAESD_FAST_TUNING=
blocking, empty caches: tuning inside the calls). Prints a table; writes first_use.json, and the tuning processes'
logs, under $OUT when it is set.
"""

from __future__ import annotations

import argparse
import shutil
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = [("256² B=1", 1, 32, 32), ("256² B=64", 64, 32, 32), ("512² B=1", 1, 64, 64), ("256² B=4 (new)", 4, 32, 32)]
# TAEHV: (name, latent frames; 0 = one decode_step on a stream), at taew2_2's 44x80 latents (704x1280 frames)
TAEHV_SHAPES = [("13 frames", 4), ("step", 0), ("25 frames (new)", 7)]
CALLS = 3
TUNED_REPS = 20


def shape_names(model: str) -> list[str]:
    return [s[0] for s in (TAEHV_SHAPES if model == "taehv" else SHAPES)]


def _load(model_name: str):
    """(the model's decoder, {shape name: call}) for the measured process: each call decodes its shape once."""
    import torch

    if model_name == "taesd":
        from taesd_fast import TAESD

        model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
        latents = {name: torch.randn(b, 32, h, w, device="cuda", dtype=torch.float16) for name, b, h, w in SHAPES}
        return model.decoder, {name: (lambda z=z: model.decode(z)) for name, z in latents.items()}
    from taesd_fast.apps.bench.taehv import random_decoder

    model = random_decoder("taew2_2").to("cuda", torch.float16)
    calls = {}
    for name, t in TAEHV_SHAPES:
        z = torch.randn(1, max(t, 1), model.latent_channels, 44, 80, device="cuda", dtype=torch.float16)
        if t:
            calls[name] = lambda z=z: model.decode_video(z)
        else:  # one stream: each call continues it with one latent frame
            stream = {"state": None}

            def step(z=z[:, 0], stream=stream):
                frames, stream["state"] = model.decode_step(z, stream["state"])
                return frames

            calls[name] = step
    return model.decoder, calls


def _profiled(fn, top: int = 25) -> str:
    """Run fn under cProfile; its `top` costliest functions by cumulative time, as text."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def gpu_ms(fn) -> float:
    """Median GPU time of TUNED_REPS calls of fn, ms, between CUDA events on the current stream (the wall time per
    call, tuned_ms, also holds the host's time; the two apart show host overhead)."""
    import torch

    times = []
    for _ in range(TUNED_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def child(backend: str, model_name: str, profile_first: bool) -> dict:
    """One measured process (run with the cache env vars already set by the parent)."""
    t_start = time.perf_counter()
    import torch

    import taesd_fast
    from taesd_fast import dispatch

    out = {"import_s": time.perf_counter() - t_start, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tuning": dispatch.get_tuning(), "backend": backend, "calls": {}, "tuned_ms": {}, "tuned_gpu_ms": {},
           "after_tuning_first_call_s": {}, "model": model_name}
    taesd_fast.set_backend(backend)
    t = time.perf_counter()
    decoder, calls = _load(model_name)
    out["from_pretrained_s"] = time.perf_counter() - t

    def call(name: str) -> float:
        torch.cuda.synchronize()
        tick = time.perf_counter()
        if profile_first and "first_call_profile" not in out:
            out["first_call_profile"] = _profiled(calls[name])
        else:
            calls[name]()
        torch.cuda.synchronize()
        return time.perf_counter() - tick

    first_call = time.perf_counter()
    lives: dict = {}  # tuning process pid -> [first seen, last seen], seconds after the first call
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            now = time.perf_counter() - first_call
            for pid in dispatch.tuning_status().processes:
                lives.setdefault(pid, [now, now])[1] = now
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    names = shape_names(model_name)
    with torch.no_grad():
        for name in names:
            out["calls"][name] = [call(name) for _ in range(CALLS)]
        done = dispatch.wait_for_tuning(timeout=1800)
        out["tuning_done_after_first_call_s"] = time.perf_counter() - first_call
        out["tuning_finished"] = done
        status = dispatch.tuning_status()
        out["tuning_status"] = {"done": status.done, "pending": status.pending, "last_error": status.last_error,
                                "generation": status.generation}
        for name in names:
            out["after_tuning_first_call_s"][name] = call(name)  # a re-capture where tuning changed decisions
            call(name)
            out["tuned_ms"][name] = statistics.median(call(name) for _ in range(TUNED_REPS)) * 1e3
            out["tuned_gpu_ms"][name] = gpu_ms(calls[name])
        watching.set()
        watcher.join()
        out["tuning_processes"] = {str(pid): {"seen_from_s": a, "seen_until_s": b} for pid, (a, b) in lives.items()}
        out["tuning_peak_gpu_mb"] = status.peak_gpu_mb
        rows = [r for _, r in dispatch.rows_of(decoder)]
        out["kernel_decisions"] = f"{sum(r.choice != 'torch' for r in rows)} of {len(rows)} (layer, shape) rows"
        out["dispatch_table"] = dispatch.dispatch_table(decoder)
    out["total_s"] = time.perf_counter() - t_start
    return out


def run_child(label: str, backend: str, cache_root: Path, extra_env: dict, model: str = "taesd",
              profile_first: bool = False) -> dict:
    env = dict(os.environ, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH"))
                                        if p)  # the checkout's package, installed or not
    for var, sub in (("TAESD_FAST_CACHE_DIR", "taesd_fast"), ("TRITON_CACHE_DIR", "triton"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        (cache_root / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(cache_root / sub)
    result = cache_root / f"{label}.json"
    print(f"[{label}] caches under {cache_root} ...", flush=True)
    tick = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", backend, "--result", str(result), "--model", model]
                   + ["--profile-first"] * profile_first, env=env, check=True)
    data = json.loads(result.read_text())
    data["process_wall_s"] = time.perf_counter() - tick
    return data


def table(runs: dict) -> str:
    base = runs["torch"]
    labels = [k for k in runs if k != "torch"]
    names = shape_names(base["model"])
    what = "TAEF2" if base["model"] == "taesd" else "TAEHV taew2_2 704x1280"
    lines = [f"first use, {what} float16, {base['gpu']}, torch {base['torch']}",
             "seconds per call (each synchronized); x = vs the torch backend's call of the same index",
             f"{'call':<24}{'torch':>9}" + "".join(f"{k:>12}{'x':>7}" for k in labels)]
    for name in names:
        for i in range(CALLS):
            t = base["calls"][name][i]
            lines.append(f"{name + ' #' + str(i + 1):<24}{t:>9.3f}"
                         + "".join(f"{runs[k]['calls'][name][i]:>12.3f}{runs[k]['calls'][name][i] / t:>7.2f}"
                                   for k in labels))
    largest = lambda r: max(max(v) for v in r["calls"].values())  # noqa: E731
    lines.append(f"{'largest single call':<24}{largest(base):>9.3f}" + "".join(f"{largest(runs[k]):>12.3f}{'':>7}"
                                                                            for k in labels))
    lines.append(f"{'tuning done after (s)':<24}{'-':>9}" + "".join(
        f"{runs[k]['tuning_done_after_first_call_s']:>12.1f}{'':>7}" for k in labels))
    lines.append("tuned per call, ms (graph replays after tuning)")
    for name in names:
        t = base["tuned_ms"][name]
        lines.append(f"{name:<24}{t:>9.3f}" + "".join(
            f"{runs[k]['tuned_ms'][name]:>12.3f}{runs[k]['tuned_ms'][name] / t:>7.2f}" for k in labels))
    lines.append("tuned per call, GPU ms (CUDA events around each call)")
    for name in names:
        lines.append(f"{name:<24}{base['tuned_gpu_ms'][name]:>9.3f}" + "".join(
            f"{runs[k]['tuned_gpu_ms'][name]:>12.3f}{'':>7}" for k in labels))
    lines.append("tuning processes (pid: seen from..until s after the first call; allocator peak MB): " + "; ".join(
        f"{k} " + ", ".join(f"{pid}: {v['seen_from_s']:.1f}..{v['seen_until_s']:.1f}"
                            for pid, v in r.get("tuning_processes", {}).items()) + f" peak {r.get('tuning_peak_gpu_mb')}"
        for k, r in runs.items() if k != "torch"))
    lines.append("kernels chosen: " + ", ".join(f"{k} {r['kernel_decisions']}" for k, r in runs.items()))
    lines.append("process wall s: " + ", ".join(f"{k} {r['process_wall_s']:.1f} (import {r['import_s']:.1f})"
                                                 for k, r in runs.items()))
    for k, r in runs.items():
        if "first_call_profile" in r:
            lines += [f"--- {k}: the first call under cProfile (cumulative)", r["first_call_profile"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocking", action="store_true", help="also run a cold process with blocking tuning")
    ap.add_argument("--serial", action="store_true",
                    help="also run a cold process whose tuning compiles without its worker processes "
                         "(TAESD_FAST_TUNING_COMPILERS=0), on caches of its own")
    ap.add_argument("--model", choices=("taesd", "taehv"), default="taesd", help="what to decode (see above)")
    ap.add_argument("--profile-first", action="store_true", help="cProfile each process's first call")
    ap.add_argument("--keep", type=Path, help="put the cache folders here (must not exist) instead of a temp dir")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(child(args.child, args.model, args.profile_first), indent=1))
        return
    if args.keep is not None and args.keep.exists():
        ap.error(f"--keep {args.keep} exists; give a new folder so every cache starts empty")
    root = args.keep or Path(tempfile.mkdtemp(prefix="taesd_fast_first_use_"))
    kw = {"model": args.model, "profile_first": args.profile_first}
    runs = {"torch": run_child("torch", "torch", root / "torch", {}, **kw)}
    runs["cold"] = run_child("cold", "auto", root / "auto", {"TAESD_FAST_TUNING": "subprocess"}, **kw)
    runs["second"] = run_child("second", "auto", root / "auto", {"TAESD_FAST_TUNING": "subprocess"}, **kw)
    if args.serial:
        runs["serial"] = run_child("serial", "auto", root / "serial",
                                   {"TAESD_FAST_TUNING": "subprocess", "TAESD_FAST_TUNING_COMPILERS": "0"}, **kw)
    if args.blocking:
        runs["blocking"] = run_child("blocking", "auto", root / "blocking", {"TAESD_FAST_TUNING": "blocking"}, **kw)
    text = table(runs)
    print(text)
    if os.environ.get("OUT"):
        for sub in ("auto", "serial"):  # the tuning processes' logs: a line per job with its seconds
            log = root / sub / "taesd_fast" / "dispatch" / "tuner.log"
            if log.exists():
                shutil.copyfile(log, Path(os.environ["OUT"]) / f"first_use_tuner_{sub}.log")
        path = Path(os.environ["OUT"]) / "first_use.json"
        path.write_text(json.dumps(runs, indent=1))
        (path.with_suffix(".txt")).write_text(text + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
