"""Sizing the KV block pool from a memory budget."""
from __future__ import annotations

from tokenmill.config import EngineArgs, ModelConfig


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); falls back to total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_bytes(args: EngineArgs) -> int:
    if args.kv_cache_memory_bytes is not None:
        if args.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {args.kv_cache_memory_bytes}")
        return args.kv_cache_memory_bytes
    if not 0.0 < args.kv_cache_memory_fraction <= 0.95:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {args.kv_cache_memory_fraction}")
    return int(available_memory_bytes() * args.kv_cache_memory_fraction)


def num_kv_blocks(model: ModelConfig, block_size: int, budget_bytes: int, max_model_len: int,
                  max_num_seqs: int) -> int:
    """Blocks that fit the budget, but no more than all sequences at full length could ever use."""
    block_bytes = model.kv_bytes_per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of {block_bytes} bytes "
                         f"({block_size} tokens x {model.kv_bytes_per_token} bytes per token)")
    most_ever = max_num_seqs * (-(-max_model_len // block_size))
    return min(num_blocks, most_ever)
