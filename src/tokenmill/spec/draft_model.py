"""The `draft_model` proposer: a smaller model drafts greedily on the worker, beside the target.

- A model of its own (speculative_config "model": a directory or .gguf sharing the target's vocabulary):
  built and quantized as the target is, with its own KV layers in the target's pool and block table. Each
  step it reads the step's verified tokens (its cache stays complete) and the token sampled now, whose
  logits give draft 1; drafts 2..k feed it its own drafts at the next positions (lookahead slots).
- Self-speculation ("model" omitted or "self", "draft_num_layers": L): the target's first L layers, final
  norm and head. Its computation of verified tokens is the target's own (same inputs, same weights), so it
  shares the target's layers and cache and only runs the chain: the token sampled now, then its drafts.
  What it writes at draft positions the target overwrites next step before reading (a step writes its new
  tokens' keys and values before attending)."""
from __future__ import annotations

import torch

from tokenmill.sample.rejection import speculation_applies
from tokenmill.spec.base import WorkerProposer
from tokenmill.spec.drafter import DraftBatch, Drafter, DraftStep, reaches


class DraftModelProposer(WorkerProposer):
    name = "draft_model"


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, config, target, platform) -> None:
        super().__init__(platform.device, config.cache.enable_prefix_caching)
        spec = config.speculative
        self.num_layers = None                    # self-speculation: the target's first layers
        if spec.model in (None, "", "self"):
            n = config.model.num_layers
            if spec.draft_num_layers is None or not 1 <= spec.draft_num_layers < n:
                raise ValueError(f"speculative method 'draft_model' without a model drafts with the target's first "
                                 f"layers: draft_num_layers must be in [1, {n}), got {spec.draft_num_layers!r}")
            self.model, self.num_layers = target, spec.draft_num_layers
        else:
            self.model = load_draft_model(config, spec.model, platform)
            if self.model.config.vocab_size != config.model.vocab_size:
                raise ValueError(f"draft model {spec.model!r} has a vocabulary of {self.model.config.vocab_size} "
                                 f"tokens, the target {config.model.vocab_size}: they must share the tokenizer")
            draft_len, max_len = self.model.config.max_position_embeddings, config.scheduler.max_model_len
            if draft_len < max_len:       # its rotary table ends there: a longer sequence could not be drafted
                raise ValueError(f"draft model {spec.model!r} has {draft_len} positions (max_position_embeddings), "
                                 f"fewer than max_model_len {max_len}: pass max_model_len <= {draft_len}")

    def attention_layers(self) -> list:
        return [] if self.num_layers is not None else self.model.attention_layers()

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        hold_nothing = self.holds_nothing_now(step.sched_out)
        batch = DraftBatch()
        for sr in step.sched_out.scheduled:
            sampled = step.sampled.get(sr.request_id)
            feed, first = self._feed(sr, sampled)
            # the token sampled now sits one position past the step's slots: where the block table has no
            # lookahead slot for it, it is left out (the next step computes it as its own token anyway)
            reachable = feed[:max(0, len(sr.block_ids) * step.block_size - first)]
            drafts_now = bool(len(reachable) == len(feed) and sampled and step.k and
                              speculation_applies(sr.params, len(sr.output_token_ids) + len(sampled)))
            if reachable and self.num_layers is None:     # a cache of its own: rows may wait (spec/drafter.py)
                taken = self.take_rows(sr.request_id, sr.block_ids, first, reachable, None, drafts_now or hold_nothing)
                first, reachable = taken[:2] if taken is not None else (first, [])
            if reachable:
                batch.add(sr, first, reachable, drafts_now)
        if hold_nothing:
            for rows in self.take_all_held():             # requests this step does not schedule
                batch.add_held(rows)
        ids, positions, requests, tails = batch.ids, batch.positions, batch.requests, batch.tails
        if not tails:
            if ids and self.num_layers is None:       # held rows that must run now: fill its cache
                self._logits(step.block_size, ids, positions, requests, [len(ids) - 1], skip_logits=True)
            return {}
        tokens = self._logits(step.block_size, ids, positions, requests, [row for _, row, _ in tails])
        drafts = {sr.request_id: [t] for (sr, _, _), t in zip(tails, tokens)}
        live = [(sr, pos) for sr, _, pos in tails]
        for j in range(1, step.k):
            live = [(sr, pos) for sr, pos in live if reaches(sr, pos + j, step.block_size)]
            if not live:
                break
            feed = [drafts[sr.request_id][-1] for sr, _ in live]
            pos = [p + j for _, p in live]
            tokens = self._logits(step.block_size, feed, pos, [(sr.block_ids, p, 1) for (sr, _), p in zip(live, pos)],
                                  list(range(len(live))))
            for (sr, _), t in zip(live, tokens):
                drafts[sr.request_id].append(t)
        return drafts

    @torch.inference_mode()
    def run_held(self, held, block_size: int) -> None:
        batch = DraftBatch()
        for rows in held:
            batch.add_held(rows)
        self._logits(block_size, batch.ids, batch.positions, batch.requests, [len(batch.ids) - 1], skip_logits=True)

    def _feed(self, sr, sampled: list[int] | None) -> tuple[list[int], int]:
        """(tokens the draft model reads this step, the position of the first): self-speculation reads only
        the token sampled now; a model of its own also the step's verified tokens (its own ones and the
        accepted drafts), or a prefill chunk as it is."""
        d = sr.num_draft_tokens
        own = list(sr.token_ids[:sr.num_new_tokens - d])
        if sr.sample and not sampled:                                  # its part of the step failed
            return [], 0
        if self.num_layers is not None:
            return ([sampled[-1]], sr.start_position + len(own) + len(sampled) - 1) if sampled else ([], 0)
        return own + list(sampled or ()), sr.start_position

    def _logits(self, block_size: int, ids, positions, requests, rows: list[int], skip_logits: bool = False):
        """The draft model over `ids`; the greedy token of each of `rows`."""
        ids_t, pos_t, meta = self.step_tensors(ids, positions, requests, block_size)
        keep = torch.tensor(rows, dtype=torch.long, device=ids_t.device)
        if self.num_layers is not None:
            hidden = self.model.model(ids_t, pos_t, meta, keep, num_layers=self.num_layers)
        else:
            hidden = self.model(ids_t, pos_t, meta, keep)
        if skip_logits:
            return []
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


def load_draft_model(config, path: str, platform):
    """A supported model at `path`, built, loaded and quantized as the target is."""
    from tokenmill.config import ModelConfig
    from tokenmill.layers.quantize import load_and_quantize
    from tokenmill.loaders import open_model_source
    from tokenmill.models.registry import get_model_class
    from tokenmill.platforms import building
    source = open_model_source(path)
    cfg = ModelConfig.from_hf(source.hf_config, config.model.dtype)
    with building(platform, cfg.dtype):
        model = get_model_class(cfg.architecture)(cfg)
    load_and_quantize(model, source.iter_weights(), platform.quant_method(config.quantization, cfg.dtype), source.path)
    model.finish_loading(platform)
    return model.eval()
