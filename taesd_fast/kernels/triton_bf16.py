"""bf16 rounding and bf16 dots for the head's Triton kernels (rows triton_fused and triton_norm_split) that give the
GPU's results also under TRITON_INTERPRET=1, which is how the CPU tests run those kernels.

Triton 3.9's interpreter truncates fp32->bf16 casts and multiplies bf16 operands as raw integer bits; under it (INTERP
true) rounding is done on the bits and dot operands are widened to fp32 (exact products, same sums). On the GPU these
are the native cvt.rn and bf16 tl.dot, so the CPU tests check indexing, masking, the algorithm and where it rounds,
not the GPU instruction selection."""

from __future__ import annotations

from .triton_import import tl, triton

__all__ = ["INTERPRETED", "bf16", "dot"]

if triton is not None:

    @triton.jit
    def bf16(x, INTERP: tl.constexpr):
        """fp32 -> bf16, round to nearest even."""
        if INTERP:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def dot(a, w, acc, INTERP: tl.constexpr):
        """bf16 x bf16 -> fp32 accumulate."""
        if INTERP:
            return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, w, acc)

    INTERPRETED = type(bf16).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 when this module was imported
else:
    bf16 = dot = None
    INTERPRETED = False
