"""First use as a new user meets it: the wall time of each TAESD decode call in a fresh process whose caches
(taesd_fast's timings, Triton's and Inductor's kernels) start empty, beside the torch backend's calls, and again in a
second process that reuses those caches.

    python tools/bench_first_use.py [--serial] [--blocking] [--keep DIR]

Each measured process loads the bundled TAEF2 weights in float16 on CUDA and calls `decode` three times for each of
256² B=1, 256² B=64 and 512² B=1, then for a shape it has not seen (256² B=4), synchronizing after every call. Then
it waits for subprocess tuning to finish (how long after its first call) and times the tuned calls (graph replays);
it also records each tuning process's lifetime and its allocator's peak GPU memory.
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
CALLS = 3
TUNED_REPS = 20


def child(backend: str) -> dict:
    """One measured process (run with the cache env vars already set by the parent)."""
    t_start = time.perf_counter()
    import torch

    import taesd_fast
    from taesd_fast import TAESD, dispatch

    out = {"import_s": time.perf_counter() - t_start, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tuning": dispatch.get_tuning(), "backend": backend, "calls": {}, "tuned_ms": {},
           "after_tuning_first_call_s": {}}
    taesd_fast.set_backend(backend)
    t = time.perf_counter()
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    out["from_pretrained_s"] = time.perf_counter() - t
    latents = {name: torch.randn(b, 32, h, w, device="cuda", dtype=torch.float16) for name, b, h, w in SHAPES}

    def call(name: str) -> float:
        torch.cuda.synchronize()
        tick = time.perf_counter()
        model.decode(latents[name])
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
    with torch.no_grad():
        for name, *_ in SHAPES:
            out["calls"][name] = [call(name) for _ in range(CALLS)]
        done = dispatch.wait_for_tuning(timeout=1800)
        out["tuning_done_after_first_call_s"] = time.perf_counter() - first_call
        out["tuning_finished"] = done
        status = dispatch.tuning_status()
        out["tuning_status"] = {"done": status.done, "pending": status.pending, "last_error": status.last_error,
                                "generation": status.generation}
        for name, *_ in SHAPES:
            out["after_tuning_first_call_s"][name] = call(name)  # a re-capture where tuning changed decisions
            call(name)
            out["tuned_ms"][name] = statistics.median(call(name) for _ in range(TUNED_REPS)) * 1e3
        watching.set()
        watcher.join()
        out["tuning_processes"] = {str(pid): {"seen_from_s": a, "seen_until_s": b} for pid, (a, b) in lives.items()}
        out["tuning_peak_gpu_mb"] = status.peak_gpu_mb
        rows = [r for _, r in dispatch.rows_of(model.decoder)]
        out["kernel_decisions"] = f"{sum(r.choice != 'torch' for r in rows)} of {len(rows)} (layer, shape) rows"
    out["total_s"] = time.perf_counter() - t_start
    return out


def run_child(label: str, backend: str, cache_root: Path, extra_env: dict) -> dict:
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
    subprocess.run([sys.executable, __file__, "--child", backend, "--result", str(result)], env=env, check=True)
    data = json.loads(result.read_text())
    data["process_wall_s"] = time.perf_counter() - tick
    return data


def table(runs: dict) -> str:
    base = runs["torch"]
    labels = [k for k in runs if k != "torch"]
    lines = [f"first use, TAEF2 float16, {base['gpu']}, torch {base['torch']}",
             "seconds per call (each synchronized); x = vs the torch backend's call of the same index",
             f"{'call':<24}{'torch':>9}" + "".join(f"{k:>12}{'x':>7}" for k in labels)]
    for name, *_ in SHAPES:
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
    for name, *_ in SHAPES:
        t = base["tuned_ms"][name]
        lines.append(f"{name:<24}{t:>9.3f}" + "".join(
            f"{runs[k]['tuned_ms'][name]:>12.3f}{runs[k]['tuned_ms'][name] / t:>7.2f}" for k in labels))
    lines.append("tuning processes (pid: seen from..until s after the first call; allocator peak MB): " + "; ".join(
        f"{k} " + ", ".join(f"{pid}: {v['seen_from_s']:.1f}..{v['seen_until_s']:.1f}"
                            for pid, v in r.get("tuning_processes", {}).items()) + f" peak {r.get('tuning_peak_gpu_mb')}"
        for k, r in runs.items() if k != "torch"))
    lines.append("kernels chosen: " + ", ".join(f"{k} {r['kernel_decisions']}" for k, r in runs.items()))
    lines.append("process wall s: " + ", ".join(f"{k} {r['process_wall_s']:.1f} (import {r['import_s']:.1f})"
                                                 for k, r in runs.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocking", action="store_true", help="also run a cold process with blocking tuning")
    ap.add_argument("--serial", action="store_true",
                    help="also run a cold process whose tuning compiles without its worker processes "
                         "(TAESD_FAST_TUNING_COMPILERS=0), on caches of its own")
    ap.add_argument("--keep", type=Path, help="put the cache folders here (must not exist) instead of a temp dir")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(child(args.child), indent=1))
        return
    if args.keep is not None and args.keep.exists():
        ap.error(f"--keep {args.keep} exists; give a new folder so every cache starts empty")
    root = args.keep or Path(tempfile.mkdtemp(prefix="taesd_fast_first_use_"))
    runs = {"torch": run_child("torch", "torch", root / "torch", {})}
    runs["cold"] = run_child("cold", "auto", root / "auto", {"TAESD_FAST_TUNING": "subprocess"})
    runs["second"] = run_child("second", "auto", root / "auto", {"TAESD_FAST_TUNING": "subprocess"})
    if args.serial:
        runs["serial"] = run_child("serial", "auto", root / "serial",
                                   {"TAESD_FAST_TUNING": "subprocess", "TAESD_FAST_TUNING_COMPILERS": "0"})
    if args.blocking:
        runs["blocking"] = run_child("blocking", "auto", root / "blocking", {"TAESD_FAST_TUNING": "blocking"})
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
