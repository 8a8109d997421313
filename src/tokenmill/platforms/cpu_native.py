"""Native CPU kernels, built on first use with torch.utils.cpp_extension and cached on disk:
csrc/cpu_kernels.cpp (paged decode attention, KV cache write, rotary, SwiGLU, RMSNorm),
csrc/prefill_attention.cpp (causal attention of prefill chunks from the paged cache),
csrc/gemv_kernels.cpp (tiled float32 / int8 / int4 linear layers), csrc/decode_layer.cpp
(a decoder layer for small decode steps, chaining those kernels in one call), csrc/greedy_head.cpp
(exact greedy tokens from a float32 lm_head without its float32 logits) and csrc/amx_tiles.cpp (the int8 /
int4 tiles' larger steps on AMX, where the CPU has it).

`load()` returns the compiled module, or None when no compiler is available: callers then use the
pure-torch path, which computes the same attention (to float rounding). The build happens once per
machine: a few tens of seconds; later starts load the cached library in well under a second.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os

logger = logging.getLogger("tokenmill")
CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("cpu_kernels.cpp", "gemv_kernels.cpp", "decode_layer.cpp",
                                                     "greedy_head.cpp", "prefill_attention.cpp",
                                                     "moe_kernels.cpp", "fp8_attention.cpp", "fp8_gemv.cpp",
                                                     "tile_widen.cpp", "amx_tiles.cpp")]
HEADERS = [os.path.join(CSRC, name) for name in ("cpu_kernels.h", "gemv_kernels.h", "decode_layer.h",
                                                     "greedy_head.h", "tile_loop.h", "prefill_attention.h",
                                                     "simd_math.h", "moe_kernels.h", "fp8_attention.h",
                                                     "decode_attention.h", "fp8_gemv.h", "tile_widen.h",
                                                     "amx_tiles.h", "aten_ops.h")]


def _cpu_tag() -> str:
    """The build uses -march=native: key the cache by the CPU's flags so no other CPU loads it."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _exclusive(build_dir: str):
    """One build per directory at a time, by an flock the OS releases when its holder dies. torch's own
    lock file ("lock") outlives a build that was killed and then blocks every later start forever; while
    we hold the flock, no live build owns one, so a leftover is removed."""
    import fcntl
    with open(os.path.join(build_dir, "tokenmill.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("tokenmill: removing %s, left by a kernel build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def load():
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return None
    try:
        import sys
        from torch.utils.cpp_extension import load as build
        # the `ninja` pip package installs its binary next to this interpreter, which may not be on PATH
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        # keyed by the sources' place too: ninja rebuilds when they move, and a rebuild into a directory
        # another checkout's processes load from would replace a library under them
        digest = hashlib.sha256(CSRC.encode())
        for path in SOURCES + HEADERS:
            with open(path, "rb") as f:
                digest.update(f.read())
        src_hash = digest.hexdigest()[:10]
        root = os.environ.get("TOKENMILL_CACHE_DIR", os.path.expanduser("~/.cache/tokenmill"))
        build_dir = os.path.join(root, "kernels", f"cpu-{_cpu_tag()}-{src_hash}")
        os.makedirs(build_dir, exist_ok=True)
        with _exclusive(build_dir):
            return build(name=f"tokenmill_cpu_{src_hash}", sources=SOURCES, build_directory=build_dir,
                         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                         verbose=False)
    except Exception as e:  # no compiler or ninja: the torch path is used instead
        logger.warning("tokenmill: native CPU attention kernel unavailable (%s); using the torch path",
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
