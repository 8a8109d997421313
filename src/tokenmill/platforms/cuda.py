"""NVIDIA GPUs: bfloat16 compute, Triton attention (layers/attention/triton_kernels.py), cuBLAS and
Triton linear layers (quant/cuda_*.py), the KV pool sized from the device's free memory and
`gpu_memory_utilization` like vLLM's, decode steps captured as CUDA graphs (worker/cuda_graphs.py)."""
from __future__ import annotations

import gc

import torch

from tokenmill.platforms import torch_ops
from tokenmill.platforms.base import KVMemoryRequest, OpKernels, Platform

GiB = 2 ** 30


class CUDAPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16
    attention_backends = ("triton", "reference")
    scratch_blocks = 1          # the padded rows of a decode graph write their keys and values there

    def op_kernels(self, dtype: torch.dtype) -> OpKernels:
        # torch's own CUDA kernels; what a step launches between them is what the decode graphs remove
        return OpKernels(torch_ops.rms_norm, torch_ops.rotary, torch_ops.silu_and_mul)

    def fused_decode(self, model, config, num_blocks: int):
        """The decode steps as CUDA graphs (worker/cuda_graphs.py), unless enforce_eager; they need the
        Triton backend, whose decode kernel reads only device tensors."""
        if config.enforce_eager or config.attention_backend != "triton" or not model.supports_cuda_graphs:
            return None
        if config.model.kv_cache_dtype is not None:    # FP8 scales are calibrated by the first real step
            return None
        from tokenmill.worker.cuda_graphs import CUDAGraphDecode
        block_size, sc = config.cache.block_size, config.scheduler
        graphs = CUDAGraphDecode(model, self.device, block_size, -(-sc.max_model_len // block_size),
                                 scratch_block=num_blocks, max_batch=min(sc.max_num_seqs, config.cuda_graph_max_batch))
        graphs.capture()
        return graphs

    def moe_kernel(self, moe) -> str:
        """Float experts: the Triton grouped GEMM (one launch per projection); quantized ones run their
        methods' Triton kernels expert by expert."""
        layers = [layer for e in moe.local_experts() for layer in (e.gate_up_proj, e.down_proj)]
        return "triton" if all(layer.quant_method.is_float and not layer.has_bias for layer in layers) \
            else "grouped_linears"

    def kv_cache_bytes(self, request: KVMemoryRequest) -> int:
        """utilization x the device's memory, less what is in use now (this engine's weights, and anything
        else on the device) and the activation reserve. An explicit size must fit what is free. Tensors
        no longer referenced (a cycle not yet collected, the blocks PyTorch's allocator caches: load-time
        temporaries, an engine dropped before this one) are given back to the device first, as vLLM does
        before it profiles, so that they do not count as in use."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        if request.memory_bytes is not None:
            budget = request.memory_bytes
            if budget + request.activation_bytes > free:
                raise MemoryError(self._too_small(f"kv_cache_memory_bytes={budget}", free, total, weights,
                                                  request))
            return budget
        allowed = int(request.gpu_memory_utilization * total)
        budget = allowed - (total - free) - request.activation_bytes
        if budget <= 0:
            raise MemoryError(self._too_small(f"gpu_memory_utilization={request.gpu_memory_utilization}",
                                              free, total, weights, request))
        return budget

    def _too_small(self, asked: str, free: int, total: int, weights: int, request: KVMemoryRequest) -> str:
        return (f"{self.device} has no room for a KV cache with {asked}: the model's weights take "
                f"{weights / GiB:.2f} GiB, a step's activations need about {request.activation_bytes / GiB:.2f} "
                f"GiB, and {free / GiB:.2f} of {total / GiB:.2f} GiB are free. Raise --gpu-memory-utilization, "
                "or lower --max-num-batched-tokens (activations), or load smaller weights (--quantization "
                "int8 or int4)")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
