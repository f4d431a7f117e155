"""A user's script, run by tests/gpu/test_tuning_gpu.py in fresh processes with empty caches and default settings:
it decodes while tuning is pending and, between its calls, does what users do with CUDA. Prints one JSON line.

    python user_during_tuning.py reference   the same CUDA RNG draws, never importing taesd_fast
    python user_during_tuning.py busy        8 steps: decode (new shapes), then synchronize, draw from the CUDA
                                             RNG, capture and replay a CUDA graph of its own (global mode), call a
                                             torch.compile'd function; exits with tuning still pending
    python user_during_tuning.py exit        one decode, then exit at once
    python user_during_tuning.py second      first call on caches a finished tuning left: seconds; then calls until
                                             the stored timings choose kernels (after the background imports)
"""

from __future__ import annotations

import json
import sys
import time

import torch

STEPS = 8
SHAPES = [(1, 32, 32, 32), (2, 32, 24, 24), (1, 32, 40, 32)]


def draws_only() -> list:
    torch.manual_seed(1234)
    return [torch.randn(4, device="cuda").tolist() for _ in range(STEPS)]


def main(mode: str) -> dict:
    if mode == "reference":
        return {"draws": draws_only()}
    from taesd_fast import TAESD, dispatch

    out: dict = {"tuning": dispatch.get_tuning()}
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    gen = torch.Generator("cuda").manual_seed(7)  # the inputs come from a generator of the script's own
    latents = [torch.randn(*s, generator=gen, device="cuda", dtype=torch.float16) for s in SHAPES]
    if mode == "exit":
        with torch.no_grad():
            model.decode(latents[0])
        out["processes"] = dispatch.tuning_status().processes
        return out
    if mode == "second":
        import cProfile
        import contextlib
        import io
        import os
        import pstats

        torch.cuda.synchronize()
        profile = cProfile.Profile() if os.environ.get("PROFILE_FIRST_CALL") else contextlib.nullcontext()
        t0 = time.perf_counter()
        with torch.no_grad(), profile:
            model.decode(latents[0])
            torch.cuda.synchronize()
        out["first_call_s"] = time.perf_counter() - t0
        if isinstance(profile, cProfile.Profile):  # where the first call's time goes
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(45)
            print(text.getvalue(), file=sys.stderr)
        # While the background imports run, calls run PyTorch; the next calls decide from the stored timings.
        kernel_rows = lambda: sum(r.choice != "torch" for _, r in dispatch.rows_of(model.decoder))  # noqa: E731
        out["kernel_rows_first_call"] = kernel_rows()
        calls, t1 = 1, time.perf_counter()
        while kernel_rows() == 0 and time.perf_counter() - t1 < 10:
            with torch.no_grad():
                model.decode(latents[0])
            calls += 1
            time.sleep(0.05)
        out["kernels_after_s"] = time.perf_counter() - t0
        out["calls"] = calls
        out["processes"] = dispatch.tuning_status().processes
        out["kernel_rows"] = kernel_rows()
        return out
    compiled = torch.compile(lambda t: torch.sin(t) * 2 + 1)
    small = torch.randn(64, generator=gen, device="cuda")
    torch.manual_seed(1234)
    out.update(draws=[], pending=[], processes=set())
    for step in range(STEPS):
        with torch.no_grad():
            y = model.decode(latents[step % len(SHAPES)])
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
        out["draws"].append(torch.randn(4, device="cuda").tolist())
        status = dispatch.tuning_status()
        out["pending"].append(status.pending)
        out["processes"].update(status.processes)
        graph = torch.cuda.CUDAGraph()
        static = small.clone()
        with torch.cuda.graph(graph):  # the default, global capture mode
            result = static * 2 + 1
        static.copy_(small + step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(result, (small + step) * 2 + 1)
        torch.testing.assert_close(compiled(small), torch.sin(small) * 2 + 1)
    out["processes"] = sorted(out["processes"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
