"""Executes one scheduled step: inputs -> model forward -> logits of sampled rows -> sampler.

Owns the model, the KV cache tensors and per-request sampling state (seeded generators). Decides no
policy: it computes exactly what the SchedulerOutput lists.
"""
from __future__ import annotations

import time

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.layers.attention import get_backend
from tokenmill.layers.greedy_head import GreedyHead
from tokenmill.models.registry import get_model_class
from tokenmill.quant import get_quant_method, load_and_quantize
from tokenmill.sample.sampler import Sampler, SamplingMeta, argmax_bans
from tokenmill.worker.input_batch import build_step_inputs


class ModelRunner:
    def __init__(self, config: EngineConfig, weights) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.model = self._build_model(config, weights)
        self.backend = get_backend(config.attention_backend)
        self.kv_caches = self._allocate_kv_cache(config.model, config.cache.num_blocks)
        if config.native_decode_layers and hasattr(self.model, "bind_native_decode"):
            self.model.bind_native_decode()            # decode steps of a few rows in one native call per layer
        self.greedy_head = None            # greedy steps' tokens without the float32 logits, where it applies
        if config.greedy_screen and hasattr(self.model, "greedy_head_linear"):
            self.greedy_head = GreedyHead.build(self.model.greedy_head_linear())
        self.sampler = Sampler(seed=config.seed)
        self.generators: dict[str, torch.Generator] = {}

    @staticmethod
    def _build_model(config: EngineConfig, weights):
        t0 = time.perf_counter()
        q = config.quantization
        method = get_quant_method(q) if q else None          # an unknown name fails before loading
        model = get_model_class(config.model.architecture)(config.model)
        load_and_quantize(model, weights, method, config.model_path)
        model.eval()
        model.load_time_s = time.perf_counter() - t0
        return model

    def _allocate_kv_cache(self, cfg: ModelConfig, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        num_slots = num_blocks * self.block_size
        caches = []
        for layer in self.model.attention_layers():
            k = _lazy_zeros((cfg.num_kv_heads, num_slots, cfg.head_dim), cfg.dtype)
            v = _lazy_zeros((cfg.num_kv_heads, num_slots, cfg.head_dim), cfg.dtype)
            layer.k_cache, layer.v_cache, layer.backend = k, v, self.backend
            caches.append((k, v))
        return caches

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """One step. If it raises, the random generators are as they were before it (a retry of part of
        the step draws the same numbers)."""
        for rid in sched_out.finished_request_ids:
            self.generators.pop(rid, None)
        if sched_out.is_empty:
            return RunnerOutput({})
        saved = self._save_generators(sched_out)
        try:
            return self._check_vocab(self._execute(sched_out))
        except BaseException:
            self._restore_generators(saved)
            raise

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        inputs = build_step_inputs(sched_out, self.block_size)
        # The last layer computes only the rows that sample (all rows' keys and values are cached anyway).
        sampled_rows = inputs.sample_rows
        if sampled_rows.numel() == inputs.input_ids.numel():     # every row samples (decodes): no selection
            sampled_rows = None
        elif sampled_rows.numel() == 0:                          # nothing samples: keep one row rather than
            sampled_rows = inputs.input_ids.new_zeros(1)         # run kernels on zero rows
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, sampled_rows)
        if not inputs.sample_request_idx:
            return RunnerOutput({})
        scheduled = [sched_out.scheduled[i] for i in inputs.sample_request_idx]
        metas = [self._sampling_meta(sr) for sr in scheduled]
        tokens = self._screened_greedy(hidden, metas)
        if tokens is not None:
            return RunnerOutput({sr.request_id: [tok] for sr, tok in zip(scheduled, tokens)})
        logits = self.model.compute_logits(hidden)                           # [R, vocab] float32
        out = self.sampler(logits, metas)
        sampled = {sr.request_id: [tok] for sr, tok in zip(scheduled, out.token_ids)}
        logprobs = {sr.request_id: [lp] for sr, lp in zip(scheduled, out.logprobs) if lp is not None}
        return RunnerOutput(sampled, logprobs)

    def _check_vocab(self, out: RunnerOutput) -> RunnerOutput:
        """A sampled id outside the vocabulary never reaches the cache: its request fails instead."""
        vocab = self.config.model.vocab_size
        for rid, ids in list(out.sampled_token_ids.items()):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                del out.sampled_token_ids[rid]
                out.logprobs.pop(rid, None)
                out.failed[rid] = f"sampled token id {bad[0]} outside the vocabulary [0, {vocab})"
        return out

    def _save_generators(self, sched_out: SchedulerOutput) -> tuple | None:
        """States of the generators this step may draw from: the shared one and the seeded requests' (None
        for a seeded request whose generator the step would create). None when no row samples randomly."""
        random_rows = [sr for sr in sched_out.scheduled if sr.sample and not sr.params.greedy]
        if not random_rows:
            return None
        seeded = {sr.request_id: (g.get_state() if (g := self.generators.get(sr.request_id)) is not None else None)
                  for sr in random_rows if sr.params.seed is not None}
        return self.sampler.generator.get_state(), seeded

    def _restore_generators(self, saved: tuple | None) -> None:
        if saved is None:
            return
        shared, seeded = saved
        self.sampler.generator.set_state(shared)
        for rid, state in seeded.items():
            if state is None:
                self.generators.pop(rid, None)
            else:
                self.generators[rid].set_state(state)

    def _screened_greedy(self, hidden: torch.Tensor, metas: list[SamplingMeta]) -> list[int] | None:
        """The step's tokens from the greedy head when every row is greedy without logprobs or penalties
        (the sampler's argmax, see argmax_bans) and the head answers every row; else None (the caller
        computes the logits)."""
        if self.greedy_head is None:
            return None
        banned = argmax_bans(metas, self.greedy_head.vocab_size)
        if banned is None:
            return None
        tokens = self.greedy_head(hidden, banned)
        return None if bool((tokens < 0).any()) else tokens.tolist()

    def _sampling_meta(self, sr) -> SamplingMeta:
        gen = None
        if sr.params.seed is not None:
            gen = self.generators.get(sr.request_id)
            if gen is None:
                gen = self.generators[sr.request_id] = Sampler.make_generator(sr.params.seed)
        return SamplingMeta(sr.params, gen, sr.prompt_token_ids, sr.output_token_ids, sr.eos_token_ids)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS provides on first touch, so a large pool costs nothing at start-up. Zero,
    not garbage: padded attention reads must see finite values.

    On the CPU the pool is an anonymous mapping (Python maps it shared: 4 KiB pages on Linux). Transparent
    huge pages (a private mapping advised for them) were measured on the project's machine kind (offline
    workload, 2 runs each): no faster in steady state, and the first run 1-2 s slower (huge-page faults
    and zeroing), so none are asked for. Other dtypes: plain zeros."""
    import mmap
    import numpy as np
    if dtype != torch.float32:
        return torch.zeros(shape, dtype=dtype)
    count = int(np.prod(shape))
    region = mmap.mmap(-1, max(4 * count, 1))             # anonymous, zero-filled on first touch
    raw = np.frombuffer(region, dtype=np.float32, count=count)   # keeps `region` alive as long as the tensor
    return torch.from_numpy(raw.reshape(shape))
