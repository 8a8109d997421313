"""What differs per device, behind one interface. The engine holds one Platform; layers ask it for their
kernels once, when they are built (platforms.building / platforms.op_kernels), never by testing a tensor's
device at run time.

A platform owns: the torch device; the default compute dtype; the kernel of each elementwise op
(RMSNorm, rotary, SiLU-and-mul) per dtype; which attention backends and linear methods (quantization
formats) run on it; KV cache sizing and allocation; step synchronization; and, where it has them, fused
decode programs (CPU: the native decoder layers) and decode graphs (CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class OpKernels:
    """The kernels of one (platform, dtype), each with the contract of its torch twin in torch_ops.py:
    rms_norm(x [T, H], residual [T, H] | None, weight [H], eps) -> out, or (out, x + residual) with a
         residual (which the kernel may write into `residual` itself);
    rotary(q [T, Hq, D], k [T, Hk, D], cos [T, D/2], sin [T, D/2]) -> (q, k) rotated (possibly in place);
    silu_and_mul(gate_up [T, 2I]) -> [T, I]."""
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable


@dataclass(frozen=True)
class KVMemoryRequest:
    """What the KV pool may take, from the user's options (CacheConfig)."""
    memory_bytes: int | None          # an explicit pool size; overrides everything else
    memory_fraction: float            # CPU: of the memory available when the pool is sized
    gpu_memory_utilization: float     # GPU: the fraction of the whole device the engine may use in all
    activation_bytes: int             # the engine's estimate of a step's peak temporaries, kept free
    processes_sharing_memory: int = 1 # ranks whose pools share this memory (CPU: all ranks of the machine)


class Platform:
    name = "base"                              # registry key (platforms/__init__.py PLATFORMS)
    default_dtype = torch.float32
    attention_backends: tuple[str, ...] = ()   # backends that run here; the first is the default ("auto")
    scratch_blocks = 0                         # KV blocks past the manager's, for padded graph rows

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ---- build time -------------------------------------------------------------------------------
    def op_kernels(self, dtype: torch.dtype) -> OpKernels:
        raise NotImplementedError

    def attention_backend_name(self, requested: str) -> str:
        """The backend to run for `requested` ("auto": this platform's default); ValueError for one
        that does not run here."""
        if requested == "auto":
            return self.attention_backends[0]
        if requested not in self.attention_backends:
            raise ValueError(f"attention backend {requested!r} does not run on {self.name}; "
                             f"expected one of {list(self.attention_backends)} or 'auto'")
        return requested

    def quant_method(self, name: str | None, dtype: torch.dtype):
        """The linear method for quantization `name` (None: the checkpoint's float weights in `dtype`)."""
        from tokenmill.quant import get_quant_method
        return get_quant_method("float" if name is None else name, self.name)

    def fused_decode(self, model, config, num_blocks: int):
        """A program that runs whole decode steps of `model` (models/base.py CausalLM, its KV cache of
        num_blocks + scratch_blocks blocks bound) faster than its per-op forward, or None: the runner then
        calls the model. Interface: takes(meta) -> bool; (input_ids, positions, meta, keep_rows) -> hidden,
        the model's forward's result, from the step's host tensors; max_query_len and max_rows, what it
        takes (core/step_time.py DecodeRows: the step-time model's features follow them)."""
        return None

    def mla_backend_name(self) -> str:
        """layers/attention/mla.py's backend for latent-cache attention here."""
        return "torch"

    def moe_kernel(self, moe) -> str:
        """The layers/moe/kernels.py kernel a loaded, quantized FusedMoE runs here."""
        return "grouped_linears"

    def greedy_head(self, lm_head):
        """Greedy tokens without the float logits (layers/greedy_head.py), or None."""
        return None

    # ---- memory -----------------------------------------------------------------------------------
    def kv_cache_bytes(self, request: KVMemoryRequest) -> int:
        """The KV pool's size in bytes, asked after the model's weights are in place."""
        raise NotImplementedError

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor on this device (a KV pool: padded attention reads must see finite values)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # ---- run time ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the work queued on this device (steps are timed after it)."""

    def describe(self) -> str:
        return str(self.device)
