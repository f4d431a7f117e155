"""Triton's Gluon API for Hopper, imported once for the Gluon kernels (gluon_conv_rows, gluon_conv_tile, gluon_conv_up, gluon_conv_narrow,
gluon_fused). Without it (an older Triton, or none) the names are None and GLUON_ERROR says why; those kernels then
report it as their reason."""

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERROR: str | None = None
except Exception as e:  # noqa: BLE001  older Triton without Gluon's Hopper API, or no Triton at all
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    GLUON_ERROR = f"Gluon (Triton's Hopper API) not importable ({type(e).__name__}: {e})"

__all__ = ["GLUON_ERROR", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "tma",
           "warpgroup_mma", "warpgroup_mma_wait"]
