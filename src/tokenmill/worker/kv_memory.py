"""Sizing the KV block pool: what a step's temporaries need, and how many blocks a byte budget holds.
The budget itself comes from the platform (Platform.kv_cache_bytes), after the weights are loaded."""
from __future__ import annotations

from tokenmill.config import ModelConfig
from tokenmill.platforms import KVMemoryRequest


def activation_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An upper estimate of one step's peak temporaries: the widest per-token tensors of a layer (qkv,
    gate|up and their outputs, the residual stream) for every token of the budget, plus the sampled rows'
    float32 logits and the sampler's copies of them, with a quarter on top for allocator slack."""
    width = model.hidden_size * 4 + model.q_size + 2 * model.kv_size + model.intermediate_size * 3
    per_token = width * model.dtype.itemsize
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4 * 3
    return int((max_num_batched_tokens * per_token + logits) * 1.25)


def weight_bytes(model: ModelConfig) -> int:
    """The float weights' size at the model's dtype: embeddings, every layer's projections and norms, the
    head (unless tied)."""
    h, i = model.hidden_size, model.intermediate_size
    per_layer = h * (model.q_size + 2 * model.kv_size) + model.q_size * h + 3 * h * i + 2 * h
    heads = 1 if model.tie_word_embeddings else 2
    return (model.num_layers * per_layer + heads * model.vocab_size * h + h) * model.dtype.itemsize


def kv_memory_request(cache, model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                      processes_sharing_memory: int = 1) -> KVMemoryRequest:
    return KVMemoryRequest(cache.memory_bytes, cache.memory_fraction, cache.gpu_memory_utilization,
                           activation_bytes(model, max_num_batched_tokens, max_num_seqs), processes_sharing_memory)


def num_kv_blocks(kv_bytes_per_token: int, block_size: int, budget_bytes: int, max_model_len: int,
                  max_num_seqs: int) -> int:
    """Blocks that fit the budget, but no more than all sequences at full length could ever use."""
    block_bytes = kv_bytes_per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of {block_bytes} bytes "
                         f"({block_size} tokens x {kv_bytes_per_token} bytes per token)")
    most_ever = max_num_seqs * (-(-max_model_len // block_size))
    return min(num_blocks, most_ever)
