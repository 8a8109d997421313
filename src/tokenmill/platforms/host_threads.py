"""Host threads: the engine's steps run fastest when one thread owns the OpenMP worker team.

torch's CPU kernels (and csrc/'s at::parallel_for) run each parallel region on an OpenMP team owned by
the thread that opened it; the team's workers stay parked after the region, and GNU OpenMP (torch's
bundled libgomp) lets parked workers spin, waking within microseconds, only while the process holds no
more OpenMP threads than CPUs. An engine built on one thread (model load, calibration) and stepped on
another (AsyncEngine's loop, a Ray actor's serving thread) holds two teams: on 2 CPUs that is 4 threads,
so libgomp cuts the spin to about 1,000 iterations and every region of every step waits for sleeping
workers (batch-1 int4 decode measured 2.3x slower on the stepping thread than on the builder's).

Invariant kept by the callers: once an engine is handed to another thread to step, the thread that built
it gives its team back (`release_thread_pool()`, OpenMP 5.0's omp_pause_resource_all), and does no more
parallel torch work while the engine runs. The next parallel region on the builder's thread would make
a new team (correct, only slower for the stepping thread until it is released again).
"""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("tokenmill")

_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")   # GNU (torch's Linux wheels), Intel, LLVM
_OMP_PAUSE_SOFT = 1                                    # omp_pause_resource_t: free threads, keep settings


def loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux /proc; [] where it cannot tell)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(_OPENMP_RUNTIMES) and ".so" in p)


def release_thread_pool() -> int:
    """Free the calling thread's OpenMP worker team in every loaded runtime; returns how many runtimes
    released one (0 where none is loaded, the call is missing, or the caller is inside a parallel region).
    Safe to call at any time: a later parallel region on this thread makes a new team."""
    released = 0
    for path in loaded_openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all   # the copy already mapped, not a second one
        except (OSError, AttributeError):                       # an older runtime without OpenMP 5.0
            continue
        pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
        if pause(_OMP_PAUSE_SOFT) == 0:
            released += 1
        else:
            logger.debug("omp_pause_resource_all refused in %s", path)
    return released
