"""The compile workers with the package's own kernel rows on the GPU (dispatch/compile_pool.py): in a fresh process
with empty caches, recording each row's launches and compiling them in the workers leaves nothing for the row's
first two real launches to compile (no new Triton binary, no new NVRTC image), and they compute the conv right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    from pathlib import Path
    from taesd_fast.dispatch import compile_pool, table
    from taesd_fast.dispatch.spec import Spec

    def files():
        roots = [Path(sys.argv[1]), Path(sys.argv[2]) / "kernels"]
        return {str(p) for r in roots if r.exists() for p in r.rglob("*") if p.is_file()}

    g = torch.Generator("cuda").manual_seed(11)
    x = torch.randn(2, 64, 96, 128, device="cuda", dtype=torch.float16, generator=g)
    x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 64, 3, 3, device="cuda", generator=g) / 24).half()
    b = (torch.randn(64, device="cuda", generator=g) / 10).half()
    spec = Spec("conv2d", "cuda:0", tuple(x.shape), tuple(w.shape), torch.float16, 1, True, False, True,
                "channels_last", 1, False)
    rows = [r for r in table.rows("conv2d") if r.kernel and r.supports(spec) is None
            and "channels_last" in r.layouts]
    tasks = compile_pool.record(rows, lambda: (x, w.clone(), b.clone(), 1, None, True, 1, False))
    pool = compile_pool.CompilePool(4)
    done, errors = compile_pool.wait(pool.submit(tasks, {}), timeout=300)
    pool.shutdown()
    before = files()
    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))
    cudnn = (torch.relu(F.conv2d(x, w, b, padding=1)).double() - ref).abs().max().item()
    err = {}
    for r in rows:  # as the timing run calls them: new weights (packed again), then a second call (with PDL)
        fresh = (x, w.clone(), b.clone(), 1, None, True, 1, False)
        for _ in range(2):
            y = r.run(*fresh)
            torch.cuda.synchronize()
            err[r.name] = max(err.get(r.name, 0.0), (y.double() - ref).abs().max().item())
    new = sorted(files() - before)
    print(json.dumps({"rows": [r.name for r in rows], "tasks": [t[:3] for t in tasks], "done": done,
                      "distinct": len({compile_pool.task_key(t) for t in tasks}),
                      "errors": errors, "new": new, "err": err, "cudnn": cudnn}))
""")


def test_rows_compiled_by_the_workers_launch_without_compiling(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TAESD_FAST_CACHE_DIR=str(tmp_path / "tf"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, env["TRITON_CACHE_DIR"], env["TAESD_FAST_CACHE_DIR"]],
                          env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert len(out["rows"]) >= 3, out["rows"]  # the pointer, TMA and Hopper rows at least
    assert out["errors"] == [] and out["done"] == out["distinct"]
    assert {t[0] for t in out["tasks"]} >= {"triton"}
    compiled_again = [p for p in out["new"] if not os.path.basename(p).startswith("__triton_launcher")]
    assert compiled_again == [], compiled_again
    for name, err in out["err"].items():
        assert err <= 2 * out["cudnn"] + 1e-3, (name, err, out["cudnn"])
