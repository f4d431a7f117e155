#!/usr/bin/env python3
"""Compile the conv2d and mem_conv kernel rows for a GPU this machine does not have, and print what each compiled to.

    python3 tools/compile_check.py [--arch 90] [--rows triton_conv,gluon_conv_rows]

For a session without a GPU: each row's eager launch runs on small CPU tensors with Triton told the GPU's target
(a stand-in driver, as the tuning process's compile workers use: dispatch/compile_pool.py) and every Triton launch
turned into its compile-only warm-up, so the kernels go through Triton's whole pipeline down to ptxas and nothing
is launched. Prints per row "ok" or the compile error, then each compiled kernel's shared memory and warps (from
Triton's cache). Gluon's API moves between Triton releases: check with the Triton the GPU machine has (the device's
README names it). The PDL variants (chosen on the GPU only) are not compiled here. Exit status 1 if a row failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast.kernels import rows as kernel_rows

SMS = 132  # programs per wave are sized from the SM count: an H100/H200's
# row -> (B, C_in, C_out, H, W, upsample): shapes inside each row's rule
CASES = {
    "triton_conv": (2, 64, 64, 16, 16, 1),
    "triton_conv_tma": (2, 64, 64, 16, 16, 1),
    "gluon_conv_rows": (2, 64, 64, 32, 128, 1),
    "gluon_conv_tile": (1, 64, 64, 32, 32, 1),
    "gluon_conv_up": (1, 64, 64, 16, 32, 2),
    "gluon_conv_narrow": (1, 64, 3, 32, 64, 1),
    "triton_mem_conv": (4, 64, 64, 16, 16, 1),  # B frames of one sample; the weight takes 2 x C_in (x and past)
}


def compile_only(arch: int) -> None:
    """Triton compiles for sm_`arch` and launches nothing, in this process, from now on."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from taesd_fast.dispatch import compile_pool

    driver.set_active(compile_pool.TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    run = JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warmup_only


def check(name: str) -> str | None:
    """Compile row `name` on its case; None, or the error's first lines."""
    from taesd_fast.kernels import conv_op

    module = importlib.import_module(f"taesd_fast.kernels.{name}")
    if hasattr(module, "sm_count"):
        module.sm_count = lambda device=None: SMS
    B, c_in, c_out, H, W, up = CASES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, c_in, H, W, generator=g).half().contiguous(memory_format=torch.channels_last)
    w = torch.randn(c_out, c_in, 3, 3, generator=g).half()
    try:
        if name == "triton_mem_conv":  # kind mem_conv: x, the memory frame, a weight over both halves
            w = torch.randn(c_out, 2 * c_in, 3, 3, generator=g).half()
            module.mem_conv_launch(x, x[:1], w, torch.randn(c_out, generator=g).half(), B, True)
            return None
        conv_op.launcher(name)(x, w, torch.randn(c_out, generator=g).half(), None, 1, True, up, False)
    except Exception as e:  # noqa: BLE001 - reported per row
        return f"{type(e).__name__}: " + " | ".join(str(e).strip().splitlines()[:6])[:600]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for, e.g. 90")
    ap.add_argument("--rows", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown rows {unknown}: expected some of {', '.join(CASES)}")
    known = {r.name for r in kernel_rows.KERNEL_ROWS if r.kind in ("conv2d", "mem_conv")}
    assert set(CASES) <= known, set(CASES) - known
    os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="taesd_fast_compile_check_")
    compile_only(args.arch)
    failed = 0
    for name in names:
        why = check(name)
        failed += why is not None
        print(f"{name:20s} {'ok' if why is None else 'FAILED ' + why}", flush=True)
    for meta in sorted(Path(cache).glob("*/*.json")):
        if not meta.name.startswith("__grp__"):
            d = json.loads(meta.read_text())
            print(f"  {d['name']:28s} shared {d.get('shared')} bytes, {d.get('num_warps')} warps, "
                  f"{d.get('num_stages')} stages")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
