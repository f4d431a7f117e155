"""Compile the fused-head Triton kernels for sm_90 on a machine without a GPU (Triton ships ptxas) and report
registers, stack (spills), shared memory and which MMA it used: a cheap filter for configs before a GPU run.

    python scripts/aot_head_fused.py [--variants roll,per_t] [--block-m 32,64,128] [--block-k 32,64]
                                     [--warps 4,8] [--stages 2,3] [--no-cache] [--t1]

Ints are given the divisibility-by-16 hint the JIT gives them at the benchmark shape (352x640), pointers 16-byte
alignment, so the vectorisation matches the real run. Writes nothing (Triton's own cache aside).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONSTS = ("C", "N", "G", "BLOCK_M", "BK", "HAS_CACHE", "INTERP")


def main() -> int:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]
    ap.add_argument("--variants", default="roll,per_t")
    ap.add_argument("--block-m", type=ints, default=[32, 64, 128])
    ap.add_argument("--block-k", type=ints, default=[64])
    ap.add_argument("--warps", type=ints, default=[4, 8])
    ap.add_argument("--stages", type=ints, default=[2, 3])
    ap.add_argument("--no-cache", action="store_true", help="compile the first-chunk form (no cache frames)")
    ap.add_argument("--t1", action="store_true", help="T == 1 (Triton makes it a constant)")
    args = ap.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from taesd_fast.kernels import head_fused as hf

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    target = GPUTarget("cuda", 90, 32)
    for variant in args.variants.split(","):
        kernel = hf._KERNELS[variant]
        names = kernel.arg_names
        consts = dict(zip(CONSTS, (256, hf.N_PAD, hf.GC, 0, 0, not args.no_cache, False)))
        if args.t1:
            consts["T"] = 1
        sig = {n: "constexpr" if n in consts else "*fp32" if n == "gs_ptr" else "*bf16" if n.endswith("_ptr")
               else "fp32" if n == "eps" else "i32" for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n].startswith("*") or (sig[n] == "i32" and n != "T")}
        for bm in args.block_m:
            for bk in args.block_k:
                for nw in args.warps:
                    for ns in args.stages:
                        consts.update(BLOCK_M=bm, BK=bk)
                        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs={(names.index(n),): v for n, v in consts.items()})
                        t0 = time.time()
                        tag = f"{variant:6s} M{bm:<3d} K{bk:<3d} w{nw} s{ns}"
                        try:
                            ck = triton.compile(src, target=target, options={"num_warps": nw, "num_stages": ns})
                        except Exception as err:  # noqa: BLE001  report and go on
                            print(f"{tag}: FAILED {type(err).__name__}: {str(err)[:500]}", flush=True)
                            continue
                        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                            f.write(ck.asm["cubin"])
                            f.flush()
                            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], check=False,
                                                   capture_output=True, text=True).stdout
                        m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
                        ptx = ck.asm["ptx"]
                        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
                        print(f"{tag}: regs {m.group(1) if m else '?'} stack {m.group(2) if m else '?'} B "
                              f"smem {ck.metadata.shared} B {mma} ({time.time() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
