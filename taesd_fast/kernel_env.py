"""What the kernels' surroundings say, read by both the NVRTC loader (_backend) and the dispatcher, so that neither
has to import the other for it: where the on-disk caches live, which kernel sources are installed (their hash) and
whether the custom kernels are switched off.

    cache_dir()         root of the compiled-kernel and timings caches; TAESD_FAST_CACHE_DIR overrides
    sources_hash()      short hash of the .cu/.cuh sources, part of every timings key
    kernels_disabled()  TAESD_FAST_DISABLE_KERNELS is set: PyTorch everywhere (re-read on every call)
    apply_env(values)   set or unset variables: a tuning job's cache folders, in the tuning process and its workers

Nothing here touches CUDA or imports torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import resources

__all__ = ["apply_env", "cache_dir", "kernels_disabled", "sources_hash"]


def cache_dir() -> Path:
    """Root of on-disk caches (cubins, dispatch timings); TAESD_FAST_CACHE_DIR overrides."""
    env = os.environ.get("TAESD_FAST_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "taesd_fast"


def apply_env(values: dict[str, str | None]) -> None:
    """Set each variable to its value, or unset it where the value is None: a tuning job carries the cache folders
    the user's process had at the time of the call, and the tuning process and its compile workers apply them."""
    for var, value in values.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def kernels_disabled() -> bool:
    """True when TAESD_FAST_DISABLE_KERNELS is set to anything but "", "0" or "false": every call then runs PyTorch
    (the switch covers the Triton kernels as well as the NVRTC ones)."""
    return os.environ.get("TAESD_FAST_DISABLE_KERNELS", "").strip() not in ("", "0", "false", "False")


_sources_hash: list[str] = []


def sources_hash() -> str:
    """Short hash of every .cu/.cuh source: part of the dispatch timing keys, so edited kernels get re-timed."""
    if not _sources_hash:
        h = hashlib.sha256()
        sources = resources.csrc_sources()
        if not sources:
            raise FileNotFoundError(f"taesd_fast: no kernel sources (.cu/.cuh) in {resources.csrc_dir()}")
        for p in sources:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        _sources_hash.append(h.hexdigest()[:10])
    return _sources_hash[0]
