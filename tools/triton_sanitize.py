"""Every kernel row of the dispatcher (taesd_fast/kernels/rows.py: the Triton, Gluon and CUDA C++ conv and head
kernels and the SIMT convs) launched through its own `run` on one to three small odd shapes inside its support rule,
for compute-sanitizer memcheck / racecheck (tools/sanitize.sh).

    python3 tools/triton_sanitize.py [--conv-only | --head-only] [--rows NAME,...]

Each case: fresh random inputs, NaN-poisoned kernel outputs (kernel_checks.poisoned), and one printed line with the
relative error against the PyTorch row of the same kind run in float64, next to the PyTorch row's own f16/bf16 error
(the bound is 2x that). Both references run on the CPU, so the sanitizer sees only the kernels under test (and a few
copies). A case its row refuses is skipped with the row's reason, except on an sm_90 GPU, where every case is inside
its row's rule and a refusal is a failure. Exits 1 if any case failed; ends with "sanitize script done".
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kernel_checks import Tally, poisoned, rel_err

from taesd_fast import _backend
from taesd_fast.dispatch import Spec, table
from taesd_fast.kernels import rows as kernel_rows

EPS = 1e-12  # the head's RMS-norm eps (OutputHead's default)

# conv2d: (B, C_in, C_out, H, W, stride, upsample, bias, residual, relu, pre_clamp); inputs in the row's native layout
_SIMT = [(2, 16, 32, 19, 23, 1, 1, True, True, True, False), (2, 64, 3, 17, 9, 2, 1, False, False, False, False)]
# head: (B, C, T + 2, H, W, C_out, layout) of the activated window; head_full: (B, C, T, H, W, cache given, patch)
_HEAD_FULL_ODD = [(1, 256, 3, 13, 21, True, 0), (2, 256, 1, 9, 11, False, 2)]
_HEAD_FULL_HOPPER = [(1, 256, 3, 24, 40, True, 0), (2, 256, 1, 12, 20, False, 2),
                     (1, 256, 1, 64, 136, True, 0)]  # 136 tiles of 64 pixels > 132 SMs: programs walk two tiles
CASES: dict[tuple[str, str], list[tuple]] = {
    ("conv2d", "triton_conv"): [(2, 64, 64, 19, 21, 2, 1, True, True, True, False),  # tap mode, stride 2
                                (2, 4, 64, 7, 5, 1, 1, True, False, True, True),  # flat mode, soft clamp
                                (1, 64, 3, 9, 11, 1, 2, False, False, False, False)],  # upsample fold, narrow N
    ("conv2d", "triton_conv_tma"): [(2, 64, 64, 19, 21, 1, 1, True, True, True, False),
                                    (2, 64, 64, 9, 11, 1, 2, False, False, False, False),
                                    (1, 256, 256, 9, 11, 1, 1, True, True, True, False)],  # small grid
    ("conv2d", "gluon_conv_rows"): [(2, 64, 64, 21, 150, 1, 1, True, True, True, False),  # partial second strip
                                    (1, 64, 3, 13, 70, 1, 1, True, False, False, False),  # narrow outputs
                                    (4, 64, 64, 101, 64, 1, 1, False, True, True, False)],  # 4-row runs, last short
    ("conv2d", "gluon_conv_tile"): [(1, 64, 64, 32, 40, 1, 1, True, True, True, False),  # half-channel tiles
                                    (1, 64, 64, 71, 70, 1, 1, False, False, False, False)],  # 2-row tiles, last short
    ("conv2d", "gluon_conv_up"): [(2, 64, 64, 9, 20, 1, 2, False, False, False, False),
                                  (1, 64, 64, 90, 70, 1, 2, True, False, True, False)],  # 4 rows, last short
    ("conv2d", "gluon_conv_narrow"): [(2, 64, 3, 5, 33, 1, 1, True, False, True, False),
                                      (1, 64, 7, 298, 64, 1, 1, False, False, False, False)],  # 4 rows, N = 32
    ("conv2d", "cuda_conv_rows"): [(1, 64, 64, 64, 256, 1, 1, True, True, True, False),
                                   (2, 64, 64, 19, 130, 1, 1, False, False, False, False)],  # partial strip
    ("conv2d", "cuda_conv_tiles"): [(1, 256, 256, 40, 64, 1, 1, True, True, True, False),  # one warpgroup
                                    (3, 192, 128, 37, 50, 1, 1, False, True, False, False)],  # two; edge tiles
    ("conv2d", "cuda_conv_up"): [(2, 64, 64, 37, 50, 1, 2, True, False, True, False),  # edge tiles
                                 (1, 64, 64, 5, 3, 1, 2, False, False, False, False)],  # fewer tiles than programs
    ("conv2d", "cuda_conv_narrow"): [(2, 64, 3, 37, 50, 1, 1, True, False, False, False),  # a partial strip
                                     (1, 64, 12, 5, 130, 1, 1, False, False, False, False)],  # 2 strips, short runs
    ("conv2d", "simt_f16_tile"): _SIMT,
    ("conv2d", "simt_f16_ocb4"): _SIMT,
    ("conv2d", "simt_f16_rb"): [_SIMT[0], (2, 64, 3, 17, 9, 1, 1, False, False, False, False)],  # stride 1 only
    # mem_conv: (samples, frames per sample, C, C_out, H, W, memory, bias, relu); the weight takes 2C (x and past)
    ("mem_conv", "triton_mem_conv"): [(1, 3, 64, 64, 19, 21, True, True, True),
                                      (2, 2, 128, 160, 9, 11, False, False, True),  # two column blocks
                                      (1, 1, 256, 256, 9, 11, True, True, True)],  # small grid: 8 x 8 tiles
    ("mem_conv", "cuda_mem_conv"): [(1, 3, 64, 64, 19, 130, True, True, True),  # partial strip
                                    (2, 2, 64, 64, 9, 72, False, False, False)],  # no memory: image -1 (zeros)
    ("head", "split_bf16"): [(2, 256, 6, 13, 21, 12, "nchw"),  # cuBLAS GEMM, pixel-major g
                             (1, 256, 3, 13, 21, 3, "channels_last")],  # cuDNN, dense g; C_out 3: scalar loads
    ("head_full", "cuda_fused"): _HEAD_FULL_HOPPER,
    ("head_full", "gluon_fused"): _HEAD_FULL_HOPPER,
    ("head_full", "triton_fused"): _HEAD_FULL_ODD,
    ("head_full", "triton_norm_split"): _HEAD_FULL_ODD,
    ("head_full", "split_bf16"): _HEAD_FULL_ODD,
}


def case_spec(kind: str, name: str, case: tuple, device: str = "cuda:0") -> Spec:
    """The dispatcher's Spec of a case (what the row's support rule is asked)."""
    if kind == "conv2d":
        B, c_in, c_out, H, W, stride, up, bias, residual, relu, clamp = case
        layout = table.row(kind, name).layouts[0]
        return Spec(kind, device, (B, c_in, H, W), (c_out, c_in, 3, 3), torch.float16, stride, bias, residual, relu,
                    layout, up, clamp)
    if kind == "mem_conv":
        samples, frames, c, c_out, H, W, memory, bias, relu = case
        return Spec(kind, device, (samples * frames, c, H, W), (c_out, 2 * c, 3, 3), torch.float16, 1, bias, memory,
                    relu, "channels_last", frames=frames)
    if kind == "head":
        B, C, frames, H, W, c_out, layout = case
        return Spec(kind, device, (B, C, frames, H, W), (c_out, C, 3, 3, 3), torch.bfloat16, 1, True, False, False,
                    layout)
    B, C, T, H, W, cache, patch = case
    return Spec(kind, device, (B, C, T, H, W), (12, C, 3, 3, 3), torch.bfloat16, 1, True, cache, False, "nchw",
                patch=patch)


def describe(spec: Spec) -> str:
    s = "x".join(map(str, spec.x_shape)) + f"->{spec.w_shape[0]}"
    if spec.kind == "conv2d":
        flags = "".join(f for f, on in (("b", spec.bias), ("r", spec.residual), ("R", spec.relu)) if on) or "-"
        return s + f" s{spec.stride} up{spec.upsample}{' clamp' if spec.pre_clamp else ''} {flags} {spec.layout}"
    if spec.kind == "head":
        return s + f" {spec.layout}"
    if spec.kind == "mem_conv":
        return s + f" frames={spec.frames} memory={spec.residual} bias={spec.bias} relu={spec.relu}"
    return s + f" cache={spec.residual} patch={spec.patch}"


def make_args(spec: Spec, seed: int, device: str = "cuda") -> tuple:
    """Fresh random arguments of the row's run for this spec."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)
    if spec.kind == "conv2d":
        B, c_in, H, W = spec.x_shape
        c_out = spec.w_shape[0]
        fmt = torch.channels_last if spec.layout == "channels_last" else torch.contiguous_format
        Ho, Wo = (2 * H, 2 * W) if spec.upsample == 2 else ((H - 1) // spec.stride + 1, (W - 1) // spec.stride + 1)
        x = (rnd(B, c_in, H, W) * (2 if spec.pre_clamp else 1)).half().contiguous(memory_format=fmt)
        w = (rnd(c_out, c_in, 3, 3) / (3 * c_in**0.5)).half()
        b = (rnd(c_out) * 0.5).half() if spec.bias else None
        r = rnd(B, c_out, Ho, Wo).half().contiguous(memory_format=fmt) if spec.residual else None
        return x, w, b, spec.stride, r, spec.relu, spec.upsample, spec.pre_clamp
    if spec.kind == "mem_conv":
        n, c, H, W = spec.x_shape
        cl = torch.channels_last
        x = rnd(n, c, H, W).half().contiguous(memory_format=cl)
        memory = rnd(n // spec.frames, c, H, W).half().contiguous(memory_format=cl) if spec.residual else None
        w = (rnd(*spec.w_shape) / (3 * (2 * c) ** 0.5)).half()
        b = (rnd(spec.w_shape[0]) * 0.5).half() if spec.bias else None
        return x, memory, w, b, spec.frames, spec.relu
    c_out, C = spec.w_shape[:2]
    w = (rnd(*spec.w_shape) * (0.6 / (27 * C) ** 0.5)).bfloat16()
    b = (0.1 * rnd(c_out)).bfloat16()
    if spec.kind == "head":
        x = torch.nn.functional.silu(rnd(*spec.x_shape)).bfloat16()
        if spec.layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last_3d)
        return x, w, b
    B, _, T, H, W = spec.x_shape
    x = (3 * rnd(B, C, T, H, W)).bfloat16()
    cache = torch.nn.functional.silu(rnd(B, C, 2, H, W)).bfloat16() if spec.residual else None
    gamma = (1 + 0.1 * rnd(C, 1, 1, 1)).bfloat16()
    return x, cache, gamma, w, b, EPS, spec.patch


def on_cpu(args: tuple, dtype: torch.dtype | None = None) -> tuple:
    """Tensors copied to the CPU (and cast to dtype, when given); numbers as they are."""
    if dtype is None:
        return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    return tuple(a.cpu().to(dtype) if isinstance(a, torch.Tensor) else a for a in args)


def outputs(result) -> list:
    """A run's outputs as a list: conv2d and head return a tensor, head_full (video, new cache)."""
    return list(result) if isinstance(result, tuple) else [result]


def refusal(row, spec: Spec) -> str | None:
    """Why the row cannot run the spec here: its own rule, then (for rows that need them) the NVRTC kernels."""
    why = row.supports(spec)
    if why is None and row.nvrtc:
        why = _backend.kernels_unavailable_reason(spec.device)
    return why


def run_case(tally: Tally, row, spec: Spec, strict: bool) -> None:
    what = describe(spec)
    why = refusal(row, spec)
    if why is not None:
        (tally.fail if strict else tally.skip)(row.name, what, f"refused: {why}")
        return
    args = make_args(spec, zlib.crc32(f"{row.kind}/{row.name}/{what}".encode()))
    try:
        with poisoned():
            got = outputs(row.run(*args))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - report every row, not just the first that breaks
        tally.fail(row.name, what, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        return
    torch_row = table.reference(row.kind).run
    refs = outputs(torch_row(*on_cpu(args, torch.float64)))
    lows = outputs(torch_row(*on_cpu(args)))
    for i, (out, ref, low) in enumerate(zip(got, refs, lows)):
        if out.shape != ref.shape:
            tally.fail(row.name, what, f"output {i} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
            continue
        tally.check(row.name, what + (" (new cache)" if i else ""), out, ref, rel_err(low, ref))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--conv-only", action="store_true", help="only the conv2d and mem_conv rows")
    group.add_argument("--head-only", action="store_true", help="only the head and head_full rows")
    ap.add_argument("--rows", default="", help="comma-separated row names to run (default: every row)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    strict = torch.cuda.get_device_capability() == (9, 0)
    wanted = {n.strip() for n in args.rows.split(",") if n.strip()}
    unknown = wanted - {r.name for r in kernel_rows.KERNEL_ROWS}
    if unknown:
        sys.exit(f"--rows: no kernel row named {sorted(unknown)} (rows: {[r.name for r in kernel_rows.KERNEL_ROWS]})")
    print(f"GPU {torch.cuda.get_device_name()} (refusals {'fail' if strict else 'skip'}), torch {torch.__version__}",
          flush=True)
    tally = Tally()
    for row in kernel_rows.KERNEL_ROWS:
        conv = row.kind in ("conv2d", "mem_conv")
        if (wanted and row.name not in wanted) or (args.conv_only and not conv) or (args.head_only and conv):
            continue
        for case in CASES[(row.kind, row.name)]:
            run_case(tally, row, case_spec(row.kind, row.name, case), strict)
    return tally.exit_code()


if __name__ == "__main__":
    sys.exit(main())
