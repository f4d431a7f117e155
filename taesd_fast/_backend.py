"""Lazy NVRTC kernel loader: compiles the CUDA sources in csrc/ at first use, no CUDA toolkit needed.

Why not torch.cuda._compile_kernel: it calls cpp_extension.include_paths("cuda"), which raises
without CUDA_HOME, and adds nvcc flags. We talk to NVRTC (shipped with CUDA torch wheels) and the
driver directly through ctypes, with no headers: csrc/common.cuh is prepended as plain text. The sources are
found through `resources` (the checkout's csrc/ or the installed taesd_fast/_csrc).

This module compiles, loads and launches, nothing else: the cache root and the off switch it reads are in
kernel_env.py, the TMA descriptors its kernels take are encoded in kernels/tma.py (through `driver()`). Of the package
it imports only two leaves, resources and kernel_env, so every layer may import it.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

from . import resources
from .kernel_env import cache_dir, kernels_disabled

__all__ = ["kernels_available", "kernels_unavailable_reason", "probed", "get_kernel", "is_loaded", "Kernel"]

_PRELUDE = "common.cuh"
_HOPPER_PRELUDE = "hopper.cuh"  # after common.cuh, for the ARCH_SPECIFIC sources
_OPTIONS = ("--std=c++17", "-default-device", "-lineinfo")  # no fast-math: convs need exact fp32 accumulation
_lock = threading.RLock()
_avail: dict[int, str | None] = {}  # device index -> None (ok) or reason
_kernels: dict[tuple, "Kernel"] = {}
_libs: dict[str, ctypes.CDLL] = {}


# --------------------------------------------------------------------------- libraries


def _nvrtc() -> ctypes.CDLL:
    if "nvrtc" not in _libs:
        try:
            lib = torch.cuda._utils._get_nvrtc_library()  # finds the copy torch already loaded
        except Exception as first:  # private API may move; fall back to the soname / pip wheel dirs
            lib = _find_nvrtc_fallback(first)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _libs["nvrtc"] = lib
    return _libs["nvrtc"]


def _find_nvrtc_fallback(first: Exception) -> ctypes.CDLL:
    major = str(torch.version.cuda).split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    import site

    for sp in site.getsitepackages():
        names += [str(p) for p in Path(sp).glob(f"nvidia/*/lib/libnvrtc.so.{major}*")]
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    raise OSError(f"NVRTC not found ({first})")


def driver() -> ctypes.CDLL:
    """The CUDA driver library (libcuda), loaded once; kernels/tma.py encodes its descriptors through it too."""
    if "cuda" not in _libs:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
        _libs["cuda"] = lib
    return _libs["cuda"]


def check_driver(rc: int, what: str) -> None:
    """Raise RuntimeError naming `what` and the driver's message unless rc is CUDA_SUCCESS."""
    if rc != 0:
        s = ctypes.c_char_p()
        driver().cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(s.value or b'?').decode()})")


def _check_rtc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_nvrtc().nvrtcGetErrorString(rc).decode()}")


# --------------------------------------------------------------------------- compile


def _target(cc: int) -> tuple[str, bool]:
    """Pick the NVRTC target for compute capability cc: cubin if NVRTC knows the arch, else PTX of
    the newest arch it knows (the driver JITs it forward)."""
    lib = _nvrtc()
    n = ctypes.c_int()
    _check_rtc(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check_rtc(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    known = [a for a in archs if a <= cc]
    if not known:
        raise RuntimeError(f"NVRTC supports no arch <= sm_{cc} (supports {list(archs)})")
    best = max(known)
    return (f"sm_{cc}", True) if best == cc else (f"compute_{best}", False)


def _nvrtc_version() -> str:
    a, b = ctypes.c_int(), ctypes.c_int()
    _check_rtc(_nvrtc().nvrtcVersion(ctypes.byref(a), ctypes.byref(b)), "nvrtcVersion")
    return f"{a.value}.{b.value}"


def _read_source(source_name: str) -> str:
    prelude = resources.csrc_path(_PRELUDE).read_text()
    if source_name in ARCH_SPECIFIC:  # TMA, mbarrier and wgmma helpers: PTX that only those targets accept
        prelude += resources.csrc_path(_HOPPER_PRELUDE).read_text()
    body = resources.csrc_path(source_name).read_text()
    # Text inclusion keeps line numbers of the body readable in NVRTC logs.
    return prelude + f'\n#line 1 "{source_name}"\n' + body


def _compile(src: str, name: str, arch: str, cubin: bool, opts: list[str]) -> bytes:
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check_rtc(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None), "nvrtcCreateProgram")
    try:
        all_opts = [f"--gpu-architecture={arch}", *opts]
        arr = (ctypes.c_char_p * len(all_opts))(*[o.encode() for o in all_opts])
        rc = lib.nvrtcCompileProgram(prog, len(all_opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode(errors='replace')}")
        get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        size = ctypes.c_size_t()
        _check_rtc(get_size(prog, ctypes.byref(size)), "nvrtcGet*Size")
        buf = ctypes.create_string_buffer(size.value)
        _check_rtc(get(prog, buf), "nvrtcGet*")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# Sources that use an architecture's accelerated features (wgmma, setmaxnreg: sm_90a) and so compile for exactly
# that architecture; they run only there.
ARCH_SPECIFIC = {"conv_row_sm90.cu": 90, "conv_tile_sm90.cu": 90, "conv_up_sm90.cu": 90, "conv_narrow_sm90.cu": 90,
                 "head_g_sm90.cu": 90}


def give_up(failures: list, kernel: str, error: Exception) -> None:
    """A CUDA C++ row's compile or launch failure (`error`), remembered in its module's `failures` list, whose first
    entry the row's rule names from then on (so the dispatcher skips the row); one warning naming `kernel`."""
    failures.append(f"{type(error).__name__}: {error}")
    warnings.warn(f"taesd_fast: the {kernel} is unavailable ({failures[0]}); other kernels run instead",
                  RuntimeWarning, stacklevel=4)


# Called with (source, defines, cc) before a build that is not in the disk cache; the tuning process records the
# builds its candidates need with it (dispatch/compile_pool.py), raising to skip the build.
compile_miss_hook = None


def _binary(source_name: str, defines: dict[str, int], cc: int) -> bytes:
    """Compiled image for (source, defines, device arch), via the on-disk cache."""
    arch, cubin = (f"sm_{cc}a", True) if ARCH_SPECIFIC.get(source_name) == cc else _target(cc)
    opts = list(_OPTIONS) + [f"-D{k}={int(v)}" for k, v in sorted(defines.items())]
    src = _read_source(source_name)
    key = hashlib.sha256("\0".join([src, arch, _nvrtc_version(), *opts]).encode()).hexdigest()[:32]
    path = cache_dir() / "kernels" / arch / f"{key}.{'cubin' if cubin else 'ptx'}"
    try:
        return path.read_bytes()
    except OSError:
        pass
    if compile_miss_hook is not None:
        compile_miss_hook(source_name, defines, cc)
    image = _compile(src, source_name, arch, cubin, opts)
    try:  # best effort: an unwritable cache only costs a recompile next process
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(image)
        os.replace(tmp, path)
    except OSError:
        pass
    return image


# --------------------------------------------------------------------------- load / launch


def _ensure_context(index: int) -> None:
    """Make torch's primary context for `index` current on this thread (module loads need one)."""
    lib = driver()
    cur = ctypes.c_void_p()
    check_driver(lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value:
        return
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check_driver(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    check_driver(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check_driver(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class Kernel:
    """A loaded CUDA function. Call as kernel(grid, block, args, smem=0, stream=None, pdl=False); pdl=True launches
    with programmatic dependent launch (the kernel then must run griddepcontrol.wait before reading what the
    previous kernel writes).

    args: tensors / None -> device pointers; Python int -> int32 (range-checked); Python float ->
    float32; ctypes scalars pass through unchanged (use ctypes.c_int64 etc. for other widths), ctypes arrays and
    structures by value (a `kernels.tma.tensor_map` for a __grid_constant__ CUtensorMap parameter).
    Launches on torch.cuda.current_stream() of the kernel's device; never synchronizes.
    """

    def __init__(self, func: ctypes.c_void_p, module: ctypes.c_void_p, device: int, name: str):
        self.func, self.module, self.device, self.name = func, module, device, name
        self._smem_limit = 48 * 1024
        self.num_regs = self._attr(4)  # CU_FUNC_ATTRIBUTE_NUM_REGS; also forces a lazy load now
        self.max_threads = self._attr(0)  # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int()
        check_driver(driver().cuFuncGetAttribute(ctypes.byref(v), attr, self.func), f"cuFuncGetAttribute({self.name})")
        return v.value

    def _allow_smem(self, nbytes: int) -> None:
        if nbytes > self._smem_limit:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check_driver(driver().cuFuncSetAttribute(self.func, 8, nbytes), f"set smem {nbytes} for {self.name}")
            self._smem_limit = nbytes

    def __call__(self, grid, block, args, smem: int = 0, stream=None, pdl: bool = False) -> None:
        keep = []
        for a in args:
            if isinstance(a, torch.Tensor):
                keep.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                keep.append(ctypes.c_void_p(0))
            elif isinstance(a, bool) or isinstance(a, int):
                if not -(2**31) <= int(a) < 2**31:
                    raise OverflowError(f"{self.name}: int argument {a} does not fit int32")
                keep.append(ctypes.c_int32(int(a)))
            elif isinstance(a, float):
                keep.append(ctypes.c_float(a))
            elif isinstance(a, (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)):
                keep.append(a)  # by value (a struct: e.g. a TMA descriptor for a __grid_constant__ parameter)
            else:
                raise TypeError(f"{self.name}: unsupported kernel argument type {type(a).__name__}")
        params = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.cast(ctypes.byref(k), ctypes.c_void_p) for k in keep])
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        self._allow_smem(smem)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if pdl:  # programmatic dependent launch: may start while the previous kernel in the stream drains
            attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value[0] = 1
            config = _LaunchConfig(*g, *b, smem, stream.cuda_stream, ctypes.pointer(attr), 1)
            rc = driver().cuLaunchKernelEx(ctypes.byref(config), self.func, ctypes.cast(params, ctypes.c_void_p), None)
        else:
            rc = driver().cuLaunchKernel(self.func, *g, *b, smem, ctypes.c_void_p(stream.cuda_stream),
                                        ctypes.cast(params, ctypes.c_void_p), None)
        check_driver(rc, f"launch {self.name} grid={g} block={b} smem={smem}")


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _load(source_name: str, kernel_name: str, defines: dict[str, int], index: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(index)
    image = _binary(source_name, defines, major * 10 + minor)
    with torch.cuda.device(index):
        _ensure_context(index)
        lib = driver()
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check_driver(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image)),
                     f"cuModuleLoadData({source_name})")
        check_driver(lib.cuModuleGetFunction(ctypes.byref(fn), mod, kernel_name.encode()),
                     f"cuModuleGetFunction({kernel_name})")
        return Kernel(fn, mod, index, kernel_name)


def get_kernel(source_name: str, kernel_name: str, defines: dict[str, int] | None = None, device=None) -> Kernel:
    """Launchable `extern "C"` kernel `kernel_name` from csrc/`source_name`, compiled with
    -D defines for the given (default: current) CUDA device. Cached in-process and on disk."""
    index = _device_index(device)
    defines = dict(defines or {})
    key = (index, source_name, kernel_name, tuple(sorted(defines.items())))
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                reason = kernels_unavailable_reason(index)
                if reason is not None:
                    raise RuntimeError(f"taesd_fast kernels unavailable: {reason}")
                k = _kernels[key] = _load(source_name, kernel_name, defines, index)
    return k


def is_loaded(source_name: str, kernel_name: str, defines: dict[str, int] | None = None, device=None) -> bool:
    """True if get_kernel would return without compiling or loading (safe during graph capture)."""
    key = (_device_index(device), source_name, kernel_name, tuple(sorted(dict(defines or {}).items())))
    return key in _kernels


# --------------------------------------------------------------------------- availability


def _probe(index: int) -> str | None:
    if kernels_disabled():
        return "disabled by TAESD_FAST_DISABLE_KERNELS"
    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        return "torch is a CPU build" if torch.version.cuda is None else "ROCm builds are not supported"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _nvrtc()
    except OSError as e:
        return f"NVRTC not found: {e}"
    try:
        _load("probe.cu", "taesd_fast_probe", {}, index)
    except Exception as e:  # report why, once; callers fall back to PyTorch
        return f"compile failed: {e}"
    return None


def kernels_unavailable_reason(device=None) -> str | None:
    """None if the custom kernels can run on `device` (default: current CUDA device), else why not.
    The outcome is cached per device; TAESD_FAST_DISABLE_KERNELS=1 is re-read on every call."""
    if kernels_disabled():
        return "disabled by TAESD_FAST_DISABLE_KERNELS"
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        index = _device_index(device)
    except ValueError as e:
        return str(e)
    if index not in _avail:
        with _lock:
            if index not in _avail:
                _avail[index] = _probe(index)
    return _avail[index]


def probed(device=None) -> bool:
    """True once kernels_unavailable_reason(device) has its cached answer (asking again then does no work)."""
    try:
        return _device_index(device) in _avail
    except (ValueError, RuntimeError):
        return False


def kernels_available(device=None) -> bool:
    return kernels_unavailable_reason(device) is None
