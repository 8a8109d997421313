"""Executes one scheduled step: inputs -> model forward -> logits of sampled rows -> sampler.

Owns the model, the KV cache tensors and per-request sampling state (seeded generators), on one
platform's device (platforms/). Decides no policy: it computes exactly what the SchedulerOutput lists.
"""
from __future__ import annotations

import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.core.step_time import PER_OP, DecodeRows
from tokenmill.distributed.parallel_state import tensor_parallel
from tokenmill.layers.attention import get_backend
from tokenmill.layers.linear import step_prefill_rows
from tokenmill.layers.quantize import load_and_quantize, load_prequantized
from tokenmill.models.registry import get_model_class
from tokenmill.platforms import Platform, building
from tokenmill.sample.rejection import accept_greedy, rows_short_of_min_tokens, verify
from tokenmill.sample.sampler import Sampler, SamplingMeta, argmax_bans
from tokenmill.spec.drafter import DRAFTERS, DraftStep, make_drafter
from tokenmill.worker.input_batch import StepInputs, build_step_inputs
from tokenmill.worker.kv_memory import kv_memory_request, num_kv_blocks, weight_bytes


class ModelRunner:
    """Life cycle: __init__ (build and load the model on the platform's device), num_kv_blocks() (size the
    pool in the memory left), bind_kv_cache(num_blocks) (allocate it; fused decode programs are built
    now), then execute() once per step."""

    def __init__(self, config: EngineConfig, weights, platform: Platform) -> None:
        self.config, self.platform, self.device = config, platform, platform.device
        self.block_size = config.cache.block_size
        self.model = self._build_model(config, weights, platform)
        self.backend = get_backend(platform.attention_backend_name(config.attention_backend))
        self.fused_decode = None           # runs whole decode steps where the platform has a program for them
        self.greedy_head = None            # greedy steps' tokens without the float32 logits, where it applies
        head = self.model.greedy_head_linear()
        if config.greedy_screen and head is not None and tensor_parallel().size == 1:   # needs the whole head
            self.greedy_head = platform.greedy_head(head)
        self.sampler = Sampler(seed=config.seed)
        self.generators: dict[str, torch.Generator] = {}
        self.expert_tokens_seen = self.model.expert_token_counts()     # MoE: counts already reported
        self.drafter = None                # a worker-side proposer (spec/drafter.py), with KV layers of its own
        if config.speculative is not None and config.speculative.method in DRAFTERS:
            self.drafter = make_drafter(config, self.model, platform)
        spec = config.speculative                      # relaxed acceptance (lossy): (top_n, delta), else None
        self.relaxed = (spec.relaxed_top_n, spec.relaxed_delta) if spec and spec.acceptance == "relaxed" else None

    @staticmethod
    def _build_model(config: EngineConfig, weights, platform: Platform):
        t0 = time.perf_counter()
        fmt = config.checkpoint_quant                     # a pre-quantized checkpoint's format, or None
        name = config.quantization or (fmt.method if fmt is not None else None)
        method = platform.quant_method(name, config.model.dtype)   # unknown: fails before loading
        try:
            with building(platform, config.model.dtype):
                model = get_model_class(config.model.architecture)(config.model)
            if fmt is not None:
                from tokenmill.loaders import open_model_source
                load_prequantized(model, open_model_source(config.model_path).iter_weights, fmt, method)
            else:
                load_and_quantize(model, weights, method, config.model_path)
            model.finish_loading(platform)
        except torch.OutOfMemoryError as e:
            raise MemoryError(f"{platform.device} ran out of memory loading the weights: the model needs about "
                              f"{weight_bytes(config.model) / 2**30:.2f} GiB at {config.model.dtype} before "
                              "quantization. Load fewer bytes (--quantization int8 or int4), free the device, "
                              f"or choose another (--device). ({e})") from None
        model.eval()
        model.load_time_s = time.perf_counter() - t0
        return model

    def num_kv_blocks(self, processes_sharing_memory: int = 1) -> int:
        """Blocks of this rank's KV pool the platform's memory rule allows now that the weights are in
        place (`processes_sharing_memory` ranks on this machine split the CPU's budget)."""
        c = self.config
        request = kv_memory_request(c.cache, c.model, c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs,
                                    processes_sharing_memory)
        budget = self.platform.kv_cache_bytes(request)
        return num_kv_blocks(self.kv_bytes_per_token(), self.block_size, budget, c.scheduler.max_model_len,
                             c.scheduler.max_num_seqs)

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as computed with (packed copies included; tensors of >= 2 dims)."""
        return sum(t.numel() * t.element_size() for t in
                   list(self.model.parameters()) + list(self.model.buffers()) if t.dim() >= 2)

    def kv_bytes_per_token(self) -> int:
        """What every layer caches for one token on this rank (its kv heads, or MLA's latent), in bytes."""
        dtype = self.config.model.cache_dtype
        return sum(a.cache_spec().bytes_per_token(dtype) for a in self.cache_layers())

    def cache_layers(self) -> list:
        """Every layer with a KV cache: the target's, then a drafter's (one pool, one block table)."""
        return self.model.attention_layers() + (self.drafter.attention_layers() if self.drafter else [])

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache tensors as its KVCacheSpec names them ([heads, num_blocks *
        block_size, width], plus the platform's scratch blocks past num_blocks), set them and a backend
        of the spec's kind on the layer; then build the platform's fused decode program."""
        dtype, slots = self.config.model.cache_dtype, (num_blocks + self.platform.scratch_blocks) * self.block_size
        try:
            for layer in self.cache_layers():
                spec = layer.cache_spec()
                for name, shape in spec.shapes(slots):
                    setattr(layer, name, self.platform.allocate(shape, dtype))
                layer.backend = self._backend(spec.kind)
                if self.config.model.kv_cache_dtype == torch.float8_e4m3fn:
                    layer.kv_scales = self._kv_scales(layer, spec)
        except torch.OutOfMemoryError:
            need = self.kv_bytes_per_token() * slots
            raise MemoryError(f"{self.platform.device} ran out of memory allocating the KV cache "
                              f"({need / 2**30:.2f} GiB for {num_blocks} blocks of {self.block_size} tokens). "
                              "Lower --gpu-memory-utilization or set --kv-cache-memory-bytes") from None
        self.fused_decode = self.platform.fused_decode(self.model, self.config, num_blocks)

    def decode_rows(self) -> DecodeRows:
        """Which steps the fused decode program (bound with the KV cache) computes as decode rows, for the
        step-time model's features (core/step_time.py); PER_OP where there is no program."""
        program = self.fused_decode
        if program is None:
            return PER_OP
        return DecodeRows(program.max_query_len, program.max_rows)

    def _kv_scales(self, layer, spec):
        """An FP8 cache's scales for one layer: the checkpoint's, else calibrated on its first tokens."""
        from tokenmill.layers.attention.fp8_kv import KVScales
        scales = KVScales(spec.tensors[0][1])
        given = getattr(layer, "checkpoint_kv_scales", {})
        if given:
            if set(given) != {"k", "v"}:
                raise ValueError(f"the checkpoint gives only the {sorted(given)} KV cache scale of an attention layer")
            scales.set(given["k"], given["v"])
        return scales.to(self.platform.device)

    def _backend(self, kind: str):
        """The backend of a cache spec's kind: the configured attention backend, or the MLA one."""
        if kind == "attention":
            return self.backend
        from tokenmill.layers.attention.mla import get_mla_backend
        return get_mla_backend(self.platform.mla_backend_name())

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """One step. If it raises, the random generators are as they were before it (a retry of part of
        the step draws the same numbers). A step that schedules nothing still ends the finished and
        preempted requests' state here and in the drafter."""
        for rid in sched_out.finished_request_ids:
            self.generators.pop(rid, None)
        if self.drafter is not None:
            self.drafter.begin_step(sched_out, self.block_size)
        if sched_out.is_empty:
            return RunnerOutput({})
        saved = self._save_generators(sched_out)
        try:
            out = self._execute(sched_out)
        except BaseException:
            self._restore_generators(saved)
            raise
        if self.expert_tokens_seen is not None:
            counts = self.model.expert_token_counts()
            out.expert_tokens = [now - before for now, before in zip(counts, self.expert_tokens_seen)]
            self.expert_tokens_seen = counts
        return out

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        inputs = build_step_inputs(sched_out, self.block_size)             # on the host
        hidden = self._forward(inputs, self._rows_to_keep(inputs))
        every_row = hidden
        if self.drafter is not None and inputs.sample_rows.numel() != hidden.shape[0]:
            hidden = hidden.index_select(0, inputs.sample_rows.to(hidden.device))
        out = self._check_vocab(self._sample(sched_out, inputs, hidden))
        if self.drafter is not None:
            starts = [s.query_start for s in inputs.meta.seqs]
            out.draft_token_ids = self.drafter.propose(DraftStep(sched_out, starts, every_row, out.sampled_token_ids,
                                                                 sched_out.num_lookahead_tokens, self.block_size))
        return out

    def _rows_to_keep(self, inputs: StepInputs) -> torch.Tensor | None:
        """The rows the last layer computes: those that sample (every row's keys and values are cached
        anyway); None for all of them (every row samples, or a drafter reads every row's hidden state)."""
        sampled_rows = inputs.sample_rows
        if self.drafter is not None or sampled_rows.numel() == inputs.input_ids.numel():
            return None
        if sampled_rows.numel() == 0:                            # nothing samples: keep one row rather than
            return inputs.input_ids.new_zeros(1)                 # run kernels on zero rows
        return sampled_rows

    def _sample(self, sched_out: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor) -> RunnerOutput:
        """hidden: the rows that sample, in inputs.sample_rows' order -> the step's tokens."""
        if not inputs.sample_request_idx:
            return RunnerOutput({})
        scheduled = [sched_out.scheduled[i] for i in inputs.sample_request_idx]
        metas = [self._sampling_meta(sr) for sr in scheduled]
        if inputs.sample_num_rows is not None:                   # some requests carry drafts
            return self._verify_drafts(hidden, scheduled, metas, inputs.sample_num_rows)
        tokens = self._screened_greedy(hidden, metas)
        if tokens is not None:
            return RunnerOutput({sr.request_id: [tok] for sr, tok in zip(scheduled, tokens)})
        logits = self.model.compute_logits(hidden)                           # [R, vocab] float32
        out = self.sampler(logits, metas)
        sampled = {sr.request_id: [tok] for sr, tok in zip(scheduled, out.token_ids)}
        logprobs = {sr.request_id: [lp] for sr, lp in zip(scheduled, out.logprobs) if lp is not None}
        return RunnerOutput(sampled, logprobs)

    def _forward(self, inputs: StepInputs, keep_rows):
        """The step's hidden states on the device: a fused decode program where it takes the step (from
        the host tensors), else the model's forward on the inputs copied to the device."""
        if self.fused_decode is not None and self.fused_decode.takes(inputs.meta):
            return self.fused_decode(inputs.input_ids, inputs.positions, inputs.meta, keep_rows)
        inputs = inputs.to(self.device)
        if keep_rows is not None:
            keep_rows = keep_rows.to(self.device, non_blocking=True)
        with step_prefill_rows(inputs.prefill_rows):
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, keep_rows)

    def _verify_drafts(self, hidden, scheduled, metas, num_rows: list[int]) -> RunnerOutput:
        """hidden: per request that samples, its last 1 + d rows (d drafts). Requests with drafts get their
        accepted drafts plus one token (sample/rejection.py); the others are sampled as usual."""
        screened = self._screened_verify(hidden, scheduled, metas, num_rows)
        if screened is not None:
            return screened
        logits = self.model.compute_logits(hidden)                       # [sum(num_rows), vocab] float32
        sampled: dict[str, list[int]] = {}
        plain, row = [], 0
        for sr, meta, n in zip(scheduled, metas, num_rows):
            if n == 1:
                plain.append((sr, meta, row))
            else:
                drafts = list(sr.token_ids[sr.num_new_tokens - sr.num_draft_tokens:])
                sampled[sr.request_id] = verify(self.sampler, logits[row:row + n], drafts, meta, self.relaxed)
            row += n
        logprobs = {}
        if plain:
            rows = torch.tensor([r for _, _, r in plain], dtype=torch.long, device=logits.device)
            out = self.sampler(logits.index_select(0, rows), [m for _, m, _ in plain])
            for (sr, _, _), token, lp in zip(plain, out.token_ids, out.logprobs):
                sampled[sr.request_id] = [token]
                if lp is not None:
                    logprobs[sr.request_id] = [lp]
        return RunnerOutput(sampled, logprobs)

    def _screened_verify(self, hidden, scheduled, metas, num_rows: list[int]) -> RunnerOutput | None:
        """Greedy verification from the greedy head, without the float logits, where every request is greedy
        without logprobs or penalties and acceptance is strict: each row's target token (its min_tokens bans
        at that row's position, as verify's masking), the drafts accepted while they equal it, then the
        target's token. None (the caller computes the logits) otherwise, or where the head leaves a row
        unanswered."""
        if self.greedy_head is None or self.relaxed is not None:
            return None
        bans = argmax_bans(metas, self.greedy_head.vocab_size)
        if bans is None:
            return None
        row_bans = []
        for meta, banned, n in zip(metas, bans, num_rows):
            short = rows_short_of_min_tokens(meta, n)
            row_bans += [banned] * short + [[]] * (n - short)
        tokens = self.greedy_head(hidden, row_bans)
        if bool((tokens < 0).any()):
            return None
        tokens, sampled, row = tokens.tolist(), {}, 0
        for sr, n in zip(scheduled, num_rows):
            drafts = list(sr.token_ids[sr.num_new_tokens - sr.num_draft_tokens:]) if n > 1 else []
            sampled[sr.request_id] = accept_greedy(drafts, tokens[row:row + n])
            row += n
        return RunnerOutput(sampled)

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
