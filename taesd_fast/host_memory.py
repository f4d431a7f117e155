"""Host memory available to new allocations and processes: what tiling plans CPU work against
(models/taesd/tile_memory.py) and what bounds the tuning process's compile workers (dispatch/compile_pool.py)."""

from __future__ import annotations

import os

__all__ = ["available_ram"]


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (free memory plus caches the kernel can drop), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):  # no sysconf (Windows): plan as if 4 GiB were free
        return 4 << 30
