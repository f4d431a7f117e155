"""Every kernel the dispatcher can choose, one Row (row.py) each: the dispatcher's table (dispatch/table.py) is its
PyTorch rows + KERNEL_ROWS, these very objects; look a row up with dispatch.table.row(kind, name).

Each row names its kernel module, named after the row (split_bf16's module holds both its kinds; the three SIMT
rows share simt_conv); the module defines the row's support rule (`spec_unsupported_reason(spec)`), its
launch (`run`) and whether it is loaded (`spec_ready(spec)`). Nothing here imports a kernel module, Triton or CUDA:
each function imports its module on first call (importing Triton takes about a second), and the rows answer
"CPU tensor" for CPU specs without importing anything. A row's launch is resolved at its first call and called
directly from then on.

DEFAULT_ORDER is the preference where nothing was measured (forced-kernel mode): the latency kernels first (their
rules admit only the small problems they are built for), then the row-streaming and TMA kernels, the pointer kernel
(every shape), the small-tile kernel, the CUDA row and tile kernels, then the SIMT convs. `forced_order(layout)` puts
the rows that read the input's layout natively first, so NCHW inputs reach the SIMT convs.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time

from .row import Row

__all__ = ["DEFAULT_ORDER", "KERNEL_ROWS", "forced_order", "import_all", "import_in_background", "importing"]


def _module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _supports(module: str, attr: str = "spec_unsupported_reason", *extra):
    def supports(spec) -> str | None:
        if not spec.device.startswith("cuda"):  # every kernel row needs CUDA; the module need not be imported
            return "CPU tensor"
        return getattr(_module(module), attr)(spec, *extra)

    return supports


def _ready(module: str, attr: str = "spec_ready", *extra):
    return lambda spec: getattr(_module(module), attr)(spec, *extra)


def _run(module: str, attr: str = "run", **fixed):
    """The row's launch: its module's function, imported at the first call and called directly from then on, so a
    call path that torch.compile traces holds no import."""
    fn = None

    def run(*args):
        nonlocal fn
        if fn is None:
            fn = functools.partial(getattr(_module(module), attr), **fixed)
        return fn(*args)

    return run


def _kernel(name: str, kind: str, module: str, run: str = "run", supports: tuple = (), ready: tuple = (),
            layouts: tuple = ("channels_last",), nvrtc: bool = True, variants: str | None = None, **fixed) -> Row:
    """A kernel row whose functions live in `module` (named as the row, where one module holds one row): run is the
    function named `run`, supports and ready are (attribute, *extra arguments) of its rule and readiness check
    (default: spec_unsupported_reason and spec_ready), variants the name of its Row.variants function, if any.
    `fixed` are keyword arguments bound to run."""
    return Row(name, kind, _run(module, run, **fixed), _supports(module, *supports), ready=_ready(module, *ready),
               layouts=layouts, nvrtc=nvrtc, module=module, variants=variants and _run(module, variants))


def _conv(name: str, module: str, nvrtc: bool = False, variants: str | None = None) -> Row:
    return _kernel(name, "conv2d", module, nvrtc=nvrtc, variants=variants)


def _simt(variant: str) -> Row:
    return _kernel(f"simt_f16_{variant}", "conv2d", "simt_conv", supports=("spec_unsupported_reason", variant),
                   ready=("spec_ready", variant), layouts=("nchw",), variant=variant)


_NCDHW = ("nchw", "strided")  # the fused heads read NCDHW features and chunk slices of them in place
_ANY_LAYOUT = ("nchw", "channels_last")

KERNEL_ROWS: list[Row] = [
    # conv2d: f16 3x3 convs with the fused epilogue (conv_contract)
    _conv("triton_conv", "triton_conv"),  # Triton pointer kernel: every contract shape, sm_80+
    _conv("triton_conv_tma", "triton_conv_tma", variants="grow_variants"),  # Triton TMA tiles: stride 1,
    # C_in % 16 == 0, sm_90+; variants: the TGrow fold (models/taehv/layers.py grow_conv)
    _conv("gluon_conv_rows", "gluon_conv_rows"),  # Gluon row streaming: 64->64 and 64->(<=16), W >= 64, sm_90
    _conv("gluon_conv_tile", "gluon_conv_tile"),  # Gluon small tiles: 64->64, W >= 16, sm_90
    _conv("gluon_conv_up", "gluon_conv_up"),  # Gluon upsample fold: 64->64 up 2, no residual, one wave, sm_90
    _conv("gluon_conv_narrow", "gluon_conv_narrow"),  # Gluon narrow outputs: 64->(<=7), W <= 256, one wave, sm_90
    _conv("cuda_conv_rows", "cuda_conv_rows", nvrtc=True),  # CUDA C++ row streaming: 64->64, W > 64, sm_90
    _conv("cuda_conv_tiles", "cuda_conv_tiles", nvrtc=True),  # CUDA C++ tiles: 64k -> 128k channels, sm_90
    _conv("cuda_conv_up", "cuda_conv_up", nvrtc=True),  # CUDA C++ upsample fold: 64->64 up 2, no residual, sm_90
    _conv("cuda_conv_narrow", "cuda_conv_narrow", nvrtc=True),  # CUDA C++ projection + tap sum: 64->3 / 64->12
    # mem_conv: a TAEHV memory block's first conv on x and its past frames, with nothing concatenated
    _kernel("triton_mem_conv", "mem_conv", "triton_mem_conv", nvrtc=False),  # Triton TMA tiles, sm_90+
    _kernel("cuda_mem_conv", "mem_conv", "cuda_mem_conv"),  # CUDA C++ row streaming, two launches: 64 ch, sm_90
    _simt("tile"),  # SIMT direct convs: NCHW, <= 64 channels
    _simt("ocb4"),
    _simt("rb"),  # stride 1 only
    # head: clamp(conv3d(window)) on the activated causal window
    _kernel("split_bf16", "head", "split_bf16", run="split_head_conv", layouts=_ANY_LAYOUT),
    # head_full: RMS norm + SiLU + window + conv + clamp (+ unpatchify) in one call
    # the fused g kernels, each with the glue they share (head_full_common), then the stencil (head_stencil)
    _kernel("cuda_fused", "head_full", "cuda_fused", layouts=_NCDHW),  # CUDA C++, sm_90
    _kernel("gluon_fused", "head_full", "gluon_fused", layouts=_NCDHW),  # Gluon, sm_90
    _kernel("triton_fused", "head_full", "triton_fused", layouts=_NCDHW),  # Triton, any GPU Triton runs on
    _kernel("triton_norm_split", "head_full", "triton_norm_split", layouts=_NCDHW),  # Triton window + split conv
    _kernel("split_bf16", "head_full", "split_bf16", layouts=_ANY_LAYOUT),  # PyTorch window + split conv
]

DEFAULT_ORDER: tuple[str, ...] = (
    "gluon_conv_up", "gluon_conv_narrow", "gluon_conv_rows", "triton_conv_tma", "triton_conv", "gluon_conv_tile",
    "cuda_conv_rows", "cuda_conv_tiles", "cuda_conv_up", "cuda_conv_narrow", "simt_f16_rb", "simt_f16_ocb4",
    "simt_f16_tile",
    "triton_mem_conv", "cuda_mem_conv",
    "cuda_fused", "gluon_fused", "triton_fused", "triton_norm_split", "split_bf16",
)


def forced_order(layout: str) -> tuple[str, ...]:
    """DEFAULT_ORDER with the rows that read `layout` natively first (each group keeps its order)."""
    native = {r.name for r in KERNEL_ROWS if layout in r.layouts}
    return tuple(n for n in DEFAULT_ORDER if n in native) + tuple(n for n in DEFAULT_ORDER if n not in native)


_importing: threading.Thread | None = None
_import_started = 0.0
IMPORT_WAIT_S = 20.0  # importing() answers False past this, should the thread hang: calls then import for themselves


def import_in_background() -> None:
    """Import every kernel module (Triton, Gluon, the launch wrappers) on a daemon thread, once per process, and
    have Triton compute its own cache key (a hash of its installation, ~0.4 s): the first call on a GPU then finds
    them ready instead of spending about a second on them. Nothing there touches CUDA."""
    global _importing, _import_started
    if _importing is None:
        _importing = threading.Thread(target=import_all, name="taesd_fast-imports", daemon=True)
        _import_started = time.monotonic()
        _importing.start()


def importing() -> bool:
    """Whether import_in_background's thread is still at work (for at most IMPORT_WAIT_S after it started). A call
    that launched a kernel now would wait for it: for the imports, and for Triton's cache key (which a kernel's
    first launch needs, also when it is already compiled)."""
    return (_importing is not None and _importing.is_alive()
            and time.monotonic() - _import_started < IMPORT_WAIT_S)


def import_all() -> None:
    """Import every kernel module and compute Triton's cache key; a module that cannot import is skipped (its row
    says why when asked). Used on import_in_background's thread and by the tuning process's compile workers."""
    for name in dict.fromkeys(r.module for r in KERNEL_ROWS):
        try:
            _module(name)
        except Exception:  # noqa: BLE001 - the row reports why when it is asked
            pass
    try:
        from triton.runtime.cache import triton_key  # Triton's private helper; cached per process

        triton_key()
    except Exception:  # noqa: BLE001 - absent or moved: the first compile or load computes it
        pass
