"""A reduced draft vocabulary (FR-Spec; SGLang's speculative_token_map): drafts are chosen among the N tokens
the target emits most often, through a head of those N rows of the target's head.

A draft is only a guess that verification accepts or rejects (greedy: the target's own token; sampling:
rejection sampling with the draft as a one-hot q), so drafting from fewer tokens never changes the output,
only how often drafts are accepted. What it saves: a draft's head reads N rows instead of the vocabulary's
(default model: 49,152 x 576, 28 MB in int8, about a third of an int4 decode step at batch 1; 8,192 rows
read 4.7 MB).

The counts come from `tokenmill train-mtp` (TOKEN_COUNTS in the head's directory: how often each token
occurred in the text it trained on). The rows are the target's float head (its tied embedding, or the
checkpoint's lm_head.weight), quantized as the target's head is (int4/fp8/nvfp4: int8)."""
from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.layers.linear import Linear

TOKEN_COUNTS = "token_counts.safetensors"        # {"token_counts": [vocab] int64}


def read_token_counts(path: str) -> torch.Tensor | None:
    """[vocab] int64 counts saved beside a train-mtp head, or None where the directory has none."""
    file = os.path.join(path, TOKEN_COUNTS)
    if not os.path.isfile(file):
        return None
    from safetensors.torch import load_file
    return load_file(file)["token_counts"]


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties: the lower id), ascending: [n] int64."""
    order = torch.argsort(-counts.to(torch.int64), stable=True)
    return order[:n].sort().values


class _HeadHolder(nn.Module):                    # quantize_model picks the head's method by the name "lm_head"
    def __init__(self, head: Linear) -> None:
        super().__init__()
        self.lm_head = head


class DraftVocabHead:
    """hidden [R, H] (after the head's norm) -> each row's argmax token id among `vocab`."""

    def __init__(self, weight: torch.Tensor, vocab: torch.Tensor, quant_method) -> None:
        from tokenmill.layers.quantize import quantize_model
        self.vocab = vocab                                               # [N] int64 token ids
        head = Linear(weight.shape[1], len(vocab), dtype=torch.float32)
        head.weight.data = weight.index_select(0, vocab).float().contiguous()   # [N, H]
        holder = _HeadHolder(head)
        quantize_model(holder, quant_method)
        self.head = holder.lm_head

    def __call__(self, hidden: torch.Tensor) -> list[int]:
        return self.vocab[self.head(hidden).argmax(dim=-1).cpu()].tolist()


def build_draft_vocab_head(config, target, platform, counts: torch.Tensor | None, default_size: int | None):
    """The MTP drafter's reduced head, or None for the full vocabulary: speculative_config draft_vocab_size
    (0: full), else the head's own default (mtp_config.json), else full."""
    spec = config.speculative
    vocab_size = config.model.vocab_size
    n = spec.draft_vocab_size if spec.draft_vocab_size is not None else (default_size or 0)
    if n == 0 or n >= vocab_size:
        return None
    from tokenmill.distributed.parallel_state import tensor_parallel
    if tensor_parallel().size > 1:                  # the head's rows are split over the ranks
        if spec.draft_vocab_size:
            raise ValueError("speculative_config draft_vocab_size: not supported with tensor_parallel_size > 1; "
                             "give 0 (the whole vocabulary)")
        return None
    if counts is None:
        raise ValueError(f"speculative_config draft_vocab_size {n}: the drafter has no token counts to choose the "
                         f"tokens by ({TOKEN_COUNTS}, written by `tokenmill train-mtp`); give 0 for the full vocabulary")
    if counts.shape != (vocab_size,):
        raise ValueError(f"{TOKEN_COUNTS}: {tuple(counts.shape)} counts, the model's vocabulary has {vocab_size} tokens")
    return DraftVocabHead(head_float_weight(config, target), top_tokens(counts, n),
                          platform.quant_method(config.quantization, config.model.dtype))


def head_float_weight(config, target) -> torch.Tensor:
    """The target's lm_head as float [vocab, H]: its tied embedding, its float weight where kept, or read
    again from the checkpoint (a quantized head keeps no float copy)."""
    if config.model.tie_word_embeddings:
        return target.model.embed_tokens.weight.data
    weight = getattr(target.lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
        return weight.data
    from tokenmill.loaders import open_model_source
    from tokenmill.loaders.lazy import read_part
    for name, t in open_model_source(config.model_path).iter_weights():
        if name == "lm_head.weight":
            return read_part(t, slice(None), slice(None)).float()
    raise ValueError(f"{config.model_path}: no lm_head.weight to build a reduced draft head from")
