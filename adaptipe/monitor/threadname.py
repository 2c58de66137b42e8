"""Give the calling thread its OS name, so per-thread tools (``top -H``, /proc's
``task/<tid>/comm``, the overhead bench) can tell telemetry's threads from training's.

Python 3.11 names threads for ``threading`` alone; the kernel sees every one as the
process's name. Linux keeps 15 bytes of the name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["name_os_thread"]

_PR_SET_NAME = 15
_libc: ctypes.CDLL | None = None


def name_os_thread(name: str) -> None:
    """Set the OS name of the calling thread (Linux; elsewhere, and on failure, nothing)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no libc or no prctl: names are a convenience
        return
