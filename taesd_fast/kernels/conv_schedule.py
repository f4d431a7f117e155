"""How the Hopper conv kernels size their grids: rows per program for the row-streaming kernels (gluon_conv_rows,
cuda_conv_rows), and the one-wave rule of the latency kernels (gluon_conv_up, gluon_conv_narrow), whose convs are a chain at B=1 where
a second wave of programs would double a conv's latency."""

from __future__ import annotations

import functools

__all__ = ["one_wave_reason", "rows_per_program"]


@functools.cache  # a search over H chunk counts; launches repeat the same shapes
def rows_per_program(B: int, H: int, strips: int, slots: int) -> int:
    """Output rows per program of a row-streaming kernel with `strips` column strips and `slots` resident programs
    on the GPU: whole columns where that fills the slots, else enough row chunks for about one wave (each chunk
    re-reads 2 halo rows, so fewer, longer chunks are cheaper)."""
    best = None
    for chunks in range(1, H + 1):
        rows = -(-H // chunks)
        programs = B * strips * -(-H // rows)
        cost = -(-programs // slots) * (rows + 2)
        if best is None or cost < best[0]:
            best = (cost, rows)
    return best[1]


def one_wave_reason(x_shape, rows_per_program_for, sms: int) -> str | None:
    """Why a latency kernel's grid would not fit one wave on a GPU of `sms` SMs, or None: rows_per_program_for(sms)
    is the kernel's search for rows per program, None where none fits."""
    if rows_per_program_for(sms) is None:
        return f"{tuple(x_shape)} needs more than one program per SM (a latency kernel for small images)"
    return None
