"""What the sanitizer scripts and the conv benchmark share: the kernels' poison switch, relative errors against a
float64 reference, the error bound (at most 2x PyTorch's own low-precision error against the same reference), and a
tally that prints one line per check and gives the exit status. Importing it touches no CUDA."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from taesd_fast.kernels import simt_conv, conv_contract, triton_norm_split, head_full_common

# Every kernel output the API lets us poison: the tensor-core convs' outputs (conv_contract.new_out), the SIMT
# convs' output, the fused head's g and new cache, the norm kernel's window.
POISON_FLAGS = ((conv_contract, "POISON_OUTPUT"), (simt_conv, "POISON_OUTPUT"), (head_full_common, "POISON"),
                (triton_norm_split, "POISON"))


@contextlib.contextmanager
def poisoned():
    """Inside: every kernel NaN-fills its outputs before it launches, so an element it fails to write shows as NaN.
    The flags are restored after (timed runs must not pay for the fill)."""
    saved = [getattr(m, name) for m, name in POISON_FLAGS]
    for m, name in POISON_FLAGS:
        setattr(m, name, True)
    try:
        yield
    finally:
        for (m, name), old in zip(POISON_FLAGS, saved):
            setattr(m, name, old)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64, on ref's device, one sample (dim 0) at a time so that large batches need no
    float64 copy of the whole of a."""
    num = den = 0.0
    for i in range(a.shape[0]):
        r = ref[i].to(torch.float64)
        num += (a[i].to(ref.device, torch.float64) - r).pow(2).sum().item()
        den += r.pow(2).sum().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def has_nan(t: torch.Tensor) -> bool:
    return bool(t.isnan().any())


def verdict(out: torch.Tensor, ref: torch.Tensor, torch_err: float) -> tuple[float, str]:
    """(rel err of out vs the float64 ref, "ok" | "NaN" | "ERR>2x"): NaN means an element left unwritten (or a NaN
    computed); the bound is 2x PyTorch's own error on the same inputs (plus 1e-7 for outputs PyTorch gets exact)."""
    if has_nan(out):
        return float("nan"), "NaN"
    err = rel_err(out, ref)
    return err, "ok" if err <= 2 * torch_err + 1e-7 else "ERR>2x"


class Tally:
    """One printed line per check; `exit_code()` is 1 when any check failed."""

    def __init__(self):
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self.passed = 0

    def check(self, name: str, what: str, out: torch.Tensor, ref: torch.Tensor, torch_err: float) -> None:
        err, status = verdict(out, ref, torch_err)
        print(f"{name:20s} {what:44s} rel err {err:.2e} (torch {torch_err:.2e})  {status}", flush=True)
        self.record(name, what, status == "ok")

    def record(self, name: str, what: str, ok: bool) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed.append(f"{name} {what}")

    def fail(self, name: str, what: str, why: str) -> None:
        print(f"{name:20s} {what:44s} FAILED: {why}", flush=True)
        self.failed.append(f"{name} {what}: {why}")

    def skip(self, name: str, what: str, why: str) -> None:
        print(f"{name:20s} {what:44s} skipped: {why}", flush=True)
        self.skipped.append(f"{name} {what}: {why}")

    def exit_code(self) -> int:
        print(f"{self.passed} ok, {len(self.failed)} failed, {len(self.skipped)} skipped", flush=True)
        for line in self.failed:
            print(f"FAILED {line}", flush=True)
        print("sanitize script done", flush=True)
        return 1 if self.failed else 0
