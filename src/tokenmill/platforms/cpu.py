"""The CPU: float32 compute, the native kernels of csrc/ where they are built (cpu_native.py), torch's
otherwise; the KV pool sized as a fraction of the memory available and mapped lazily."""
from __future__ import annotations

import functools
import os

import torch

from tokenmill.platforms import cpu_native, torch_ops
from tokenmill.platforms.base import KVMemoryRequest, OpKernels, Platform

TORCH_OPS = OpKernels(torch_ops.rms_norm, torch_ops.rotary, torch_ops.silu_and_mul)


class CPUPlatform(Platform):
    name = "cpu"
    default_dtype = torch.float32
    attention_backends = ("cpu", "reference", "triton")   # triton: its kernels under TRITON_INTERPRET=1

    def op_kernels(self, dtype: torch.dtype) -> OpKernels:
        native = cpu_native.load()
        if native is None or dtype != torch.float32:     # the native kernels are float32 only
            return TORCH_OPS
        return _native_ops(native)

    def fused_decode(self, model, config, num_blocks: int):
        from tokenmill.distributed.parallel_state import tensor_parallel
        decoder = model.dense_decoder()
        if not config.native_decode_layers or decoder is None or tensor_parallel().size > 1:   # no all-reduce
            return None
        from tokenmill.platforms.cpu_decode import NativeDecodeProgram
        return NativeDecodeProgram.build(decoder)         # None where a layer's cache is neither float32 nor FP8

    def moe_kernel(self, moe) -> str:
        """The native grouped GEMM where it takes the experts (float32 or int8, AVX2), else the Linears."""
        from tokenmill.platforms import cpu_moe
        return "cpu_grouped" if cpu_moe.supports(moe) else "grouped_linears"

    def greedy_head(self, lm_head):
        from tokenmill.platforms.cpu_greedy_head import GreedyHead
        return GreedyHead.build(lm_head)

    def kv_cache_bytes(self, request: KVMemoryRequest) -> int:
        """The explicit size, or the fraction of the memory available now; either split between the ranks
        that share this machine (kv_cache_memory_bytes is the engine's total)."""
        total = request.memory_bytes if request.memory_bytes is not None else \
            int(available_memory_bytes() * request.memory_fraction)
        return total // request.processes_sharing_memory

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return lazy_zeros(shape, dtype)

    def describe(self) -> str:
        return f"cpu ({torch.get_num_threads()} threads)"


@functools.cache
def _native_ops(native) -> OpKernels:
    def rms_norm(x, residual, weight, eps):
        if x.dim() != 2 or (residual is not None and not residual.is_contiguous()):
            return torch_ops.rms_norm(x, residual, weight, eps)
        out = native.rms_norm(x, residual, weight, eps)            # adds x into residual in place first
        return out if residual is None else (out, residual)

    def rotary(q, k, cos, sin):                                    # q, k: views of this step's projection
        native.rotary_inplace(q, cos, sin)
        native.rotary_inplace(k, cos, sin)
        return q, k

    return OpKernels(rms_norm, rotary, native.silu_and_mul)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); falls back to total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS provides on first touch, so a large pool costs nothing at start-up. Zero,
    not garbage: padded attention reads must see finite values.

    The pool is a private anonymous mapping (4 KiB pages on Linux; Python's default, a shared one, is shmem,
    whose pages fault in 1.6x slower: 2 GiB in 1.11 s against 0.67 s on the project's machine kind). The
    first touch is the one cost left, paid by the first requests that reach a block (an Offline run of
    256 x 256 tokens on a fresh int4 engine: about 770k faults; blocks are reused most-recent-first, so a
    pool is touched only as far as the load reaches). Transparent huge pages
    (a private mapping advised for them) were measured on the project's machine kind (offline workload, 2
    runs each): no faster in steady state, and the first run 1-2 s slower (huge-page faults and zeroing),
    so none are asked for. Other dtypes: plain zeros."""
    import mmap
    import numpy as np
    if dtype != torch.float32:
        return torch.zeros(shape, dtype=dtype)
    count = int(np.prod(shape))
    region = mmap.mmap(-1, max(4 * count, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zeros on first touch
    raw = np.frombuffer(region, dtype=np.float32, count=count)   # keeps `region` alive as long as the tensor
    return torch.from_numpy(raw.reshape(shape))
