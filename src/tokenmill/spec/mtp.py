"""The `mtp` proposer: multi-token-prediction layers (models/mtp.py) on the worker, fed the target's
hidden states. From the target's own checkpoint (DeepSeek-V3/R1: model.layers.{num_hidden_layers + i}),
or from a head `tokenmill train-mtp` wrote (speculative_config "model": its directory).

Per step (spec/drafter.py): for every request, its verified positions p of the step (its own tokens and
the drafts accepted) go through the layer with t_{p+1} (the next verified token, or the token sampled
now) and the target's h_p, writing the layer's cache there (held while the request drafts nothing, then
run as one chunk). For a request that samples, the last row's
logits give draft 1 (greedy: drafts are one-hot guesses, verified losslessly); drafts 2..k chain the
layer on its own output at the next positions (the scheduler's lookahead slots). A train-mtp head drafts
among its training text's most frequent tokens by default (spec/draft_vocab.py: a head of those rows, a
sixth of the bytes at 8,192 tokens); speculative_config draft_vocab_size chooses how many (0: all).

Known gap (acceptance only): the entry at a cached block's last position p encodes t_{p+1}, which the
block's hash does not cover. A request that hits the block reads the entry its computing request wrote,
and if its own t_{p+1} differs (their prefixes part exactly at the block boundary) that entry is not its
own; rewriting it would need the target's h_p, which a prefix hit does not compute, and could not suit two
requests sharing the block at once."""
from __future__ import annotations

import json
import logging
import os

import torch

from tokenmill.layers.moe import moe_blocks
from tokenmill.models.mtp import SHARED_WITH_TARGET, build_mtp_layer
from tokenmill.models.weights import load_named_weights
from tokenmill.sample.rejection import speculation_applies
from tokenmill.spec.base import WorkerProposer
from tokenmill.spec.draft_vocab import build_draft_vocab_head, read_token_counts
from tokenmill.spec.drafter import DraftBatch, Drafter, DraftStep, reaches

logger = logging.getLogger("tokenmill")
HEAD_FILE, HEAD_CONFIG = "mtp.safetensors", "mtp_config.json"


class MTPProposer(WorkerProposer):
    name = "mtp"


class MTPDrafter(Drafter):
    name = "mtp"

    def __init__(self, config, target, platform) -> None:
        from tokenmill.layers.quantize import quantize_model
        from tokenmill.platforms import building
        super().__init__(platform.device, config.cache.enable_prefix_caching)
        self.target = target
        with building(platform, config.model.dtype):
            self.layer = build_mtp_layer(target).to(platform.device)
        load_named_weights(self.layer, mtp_weights(config, target), target.STACKED, target.IGNORED_SUFFIXES,
                           lambda n: n.endswith(SHARED_WITH_TARGET) or target.other_ranks_expert(n))
        quantize_model(self.layer, platform.quant_method(config.quantization, config.model.dtype))
        for moe in moe_blocks(self.layer):
            moe.set_kernel(platform.moe_kernel(moe))
        self.layer.eval()
        counts, default_size = _head_vocab(config)
        self.draft_head = build_draft_vocab_head(config, target, platform, counts, default_size)   # None: full

    def attention_layers(self) -> list:
        return [self.layer.self_attn]

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        hold_nothing = self.holds_nothing_now(step.sched_out)
        batch, hidden = DraftBatch(), []
        for sr, row in zip(step.sched_out.scheduled, step.query_starts):
            nxt = _verified(sr, step.sampled.get(sr.request_id))
            if nxt is None:
                continue
            drafts_now = bool(sr.request_id in step.sampled and step.k and speculation_applies(
                sr.params, len(sr.output_token_ids) + len(step.sampled[sr.request_id])))
            taken = self.take_rows(sr.request_id, sr.block_ids, sr.start_position, nxt,
                                   step.hidden[row:row + len(nxt)], drafts_now or hold_nothing)
            if taken is None:
                continue                      # held: they run with its next drafts or once enough wait
            start, run_ids, run_hidden = taken
            batch.add(sr, start, run_ids, drafts_now)
            hidden.append(run_hidden)
        if hold_nothing:
            for rows in self.take_all_held():             # requests this step does not schedule
                batch.add_held(rows)
                hidden.append(rows.hidden)
        if not batch.ids:
            return {}
        hidden = self._run(step.block_size, batch.ids, batch.positions, torch.cat(hidden), batch.requests)
        return self._chain(step, hidden, batch.tails) if batch.tails else {}

    @torch.inference_mode()
    def run_held(self, held, block_size: int) -> None:
        batch = DraftBatch()
        for rows in held:
            batch.add_held(rows)
        self._run(block_size, batch.ids, batch.positions, torch.cat([rows.hidden for rows in held]), batch.requests)

    def _run(self, block_size: int, ids, positions, prev_hidden, requests) -> torch.Tensor:
        ids_t, pos_t, meta = self.step_tensors(ids, positions, requests, block_size)
        model = self.target.model
        return self.layer.predict(model.embed_tokens, model.rotary.gather(pos_t), ids_t, pos_t, prev_hidden, meta)

    def _draft(self, hidden: torch.Tensor) -> list[int]:
        h = self.layer.shared_head.norm(hidden)
        if self.draft_head is not None:                      # the most frequent tokens only (draft_vocab.py)
            return self.draft_head(h)
        return self.target.compute_logits(h).argmax(dim=-1).tolist()

    def _chain(self, step: DraftStep, hidden, tails) -> dict[str, list[int]]:
        """Draft 1 from each tail row; drafts 2..k by running the layer on its own output at the next
        position, while the request's block table reaches it."""
        h = hidden.index_select(0, torch.tensor([r for _, r, _ in tails], device=hidden.device))
        tokens = self._draft(h)
        drafts = {sr.request_id: [t] for (sr, _, _), t in zip(tails, tokens)}
        live = [(sr, pos) for sr, _, pos in tails]
        for j in range(1, step.k):
            keep = [i for i, (sr, pos) in enumerate(live) if reaches(sr, pos + j, step.block_size)]
            if not keep:
                break
            live = [live[i] for i in keep]
            h = h.index_select(0, torch.tensor(keep, device=h.device))
            ids = [drafts[sr.request_id][-1] for sr, _ in live]
            positions = [pos + j for _, pos in live]
            requests = [(sr.block_ids, p, 1) for (sr, _), p in zip(live, positions)]
            h = self._run(step.block_size, ids, positions, h, requests)
            for (sr, _), t in zip(live, self._draft(h)):
                drafts[sr.request_id].append(t)
        return drafts


def _verified(sr, sampled: list[int] | None) -> list[int] | None:
    """t_{p+1} for each verified position p of the step: its own tokens after the first, then the accepted
    drafts and the token sampled now (a request that samples); a prefill chunk's own next token otherwise.
    None when the request's part of the step failed."""
    d = sr.num_draft_tokens
    own = list(sr.token_ids[1:sr.num_new_tokens - d])
    if sr.sample:
        return None if not sampled else own + list(sampled)
    end = sr.start_position + sr.num_new_tokens               # the token after the chunk
    prompt = sr.prompt_token_ids
    return own + [prompt[end] if end < len(prompt) else sr.output_token_ids[end - len(prompt)]]


def mtp_weights(config, target):
    """(name relative to the MTP layer, tensor): a train-mtp head's file, or the target checkpoint's first
    MTP layer (model.layers.{num_hidden_layers}.*)."""
    from tokenmill.loaders import open_model_source
    from tokenmill.loaders.lazy import read_part
    path = config.speculative.model
    if path:
        return _head_weights(path, config.model.architecture)
    prefix = f"model.layers.{config.model.num_layers}."
    source = open_model_source(config.model_path)

    def layer_tensors():                                 # lazy: only the MTP layer's tensors are read
        return ((name[len(prefix):], t) for name, t in source.iter_weights() if name.startswith(prefix))
    fmt = config.checkpoint_quant                        # DeepSeek's FP8 checkpoints: dequantize as read
    if config.model.num_mtp_layers < 1:
        weights = []
    elif fmt is not None:
        from tokenmill.quant.prequantized import dequantized_weights, read_scales
        weights = [(name, t if isinstance(t, torch.Tensor) else read_part(t, slice(None), slice(None)))
                   for name, t in dequantized_weights(layer_tensors, fmt, read_scales(layer_tensors, fmt))]
    else:
        weights = [(name, read_part(t, slice(None), slice(None))) for name, t in layer_tensors()]
    if not weights:
        raise ValueError(f"speculative method 'mtp': {config.model_path} has no MTP layers (num_nextn_predict_"
                         f"layers {config.model.num_mtp_layers}, no {prefix}* tensors); give a head "
                         "`tokenmill train-mtp` made as speculative_config {\"model\": DIR}")
    return weights


def _head_meta(path: str) -> dict:
    """A train-mtp head's mtp_config.json ({} where there is none)."""
    meta_path = os.path.join(path, HEAD_CONFIG)
    if not os.path.isfile(meta_path):
        return {}
    with open(meta_path) as f:
        return json.load(f)


def _head_vocab(config) -> tuple[torch.Tensor | None, int | None]:
    """A train-mtp head's token counts and default draft vocabulary size (None, None: none recorded)."""
    path = config.speculative.model
    if not path:
        return None, None
    return read_token_counts(path), _head_meta(path).get("draft_vocab_size")


def _head_weights(path: str, architecture: str):
    from safetensors.torch import load_file
    file = os.path.join(path, HEAD_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"speculative_config model {path!r}: no {HEAD_FILE} there (made by `tokenmill train-mtp`)")
    meta = _head_meta(path)
    if meta.get("architecture", architecture) != architecture:
        raise ValueError(f"MTP head {path!r} was trained for {meta['architecture']}, the model is {architecture}")
    return load_file(file).items()
