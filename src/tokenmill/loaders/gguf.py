"""GGUF checkpoints (llama.cpp format): config, tensors under Hugging Face names, tokenizer.

    f = GGUFFile(path)
    config = f.hf_config()                  # LlamaConfig / MistralConfig / Qwen2Config
    for name, tensor in f.iter_tensors():   # float32, HF names and shapes, Q/K rows un-permuted
        ...
    tokenizer = f.load_tokenizer()          # cached on disk after the first build

The file is memory-mapped; tensors are read and dequantized one at a time as they are iterated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TypeVar

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from tokenmill.loaders.gguf_config import architecture_of, build_hf_config
from tokenmill.loaders.gguf_deepseek import merge_kv_b
from tokenmill.loaders.gguf_dequant import SUPPORTED_TYPES, dequantize, ggml_type_name, is_supported, row_nbytes
from tokenmill.loaders.gguf_header import GGUFError, GGUFHeader, TensorInfo, read_header
from tokenmill.loaders.gguf_tokenizer import load_gguf_tokenizer

__all__ = ["GGUFFile", "GGUFError", "unpermute_rows", "permute_rows"]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # "blk.{i}.<key>.<weight|bias>" -> "model.layers.{i}.<value>.<weight|bias>"
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",          # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",                 # MoE router
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",   # DeepSeek-V3 shared experts
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",           # DeepSeek-V3 MLA
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",         # older deepseek2 files; newer split it (see _MergedKVB)
}
_WHOLE_LAYER_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}  # DeepSeek-V3 router bias
# MoE experts stacked in one GGUF tensor [E, rows, cols]: split into one HF tensor per expert
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}   # HF Mixtral's expert names
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_KV_B_PARTS = ("attn_k_b", "attn_v_b")  # deepseek2: kv_b_proj split per head, merged back on read
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope scaling; folded into hf_config().rope_parameters
_PERMUTED_ARCHS = ("llama", "mistral")  # convert_hf_to_gguf permutes Q/K rows for these, not qwen2

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def permute_rows(t: ArrayT, n_head: int) -> ArrayT:
    """HF -> llama.cpp row order of a Q or K projection (what convert_hf_to_gguf does).

    Per head, HF keeps the rotary pairs as [first halves..., second halves...]; llama.cpp interleaves
    them: row (h, 2*i + j) of the result is row (h, j * half + i) of the input.
    """
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def unpermute_rows(t: ArrayT, n_head: int) -> ArrayT:
    """llama.cpp -> HF row order; inverse of `permute_rows`.

    t: numpy array or torch tensor of any dtype, rows first (e.g. [out_features, in_features] floats,
    [out_features, row_bytes] raw quantized blocks, or a [out_features] bias). n_head: query heads
    for attn_q, key/value heads for attn_k. Returns a new array (a copy when t is not contiguous).
    """
    rows = t.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows for {n_head} heads: rows must be a multiple of 2 * n_head")
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


class GGUFFile:
    """One GGUF checkpoint of a supported architecture (llama, mistral, qwen2, mixtral, qwen3moe, deepseek2)."""

    def __init__(self, path: str):
        self.path = path
        self.header: GGUFHeader = read_header(path)  # FileNotFoundError / GGUFError
        self.architecture: str = architecture_of(self.header)  # GGUFError if unsupported
        # whole file, copy-on-write: tensors are views (no read until touched), writable for torch
        self._data = np.memmap(path, dtype=np.uint8, mode="c")
        self._config: PretrainedConfig | None = None

    def hf_config(self) -> PretrainedConfig:
        if self._config is None:
            rope_freqs = self.header.tensors.get("rope_freqs.weight")
            freqs = self._dequantize(rope_freqs) if rope_freqs is not None else None
            self._config = build_hf_config(self.header, freqs)
        return self._config

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF shape) for every weight, Q/K rows in HF order.

        Raises GGUFError before yielding anything if a tensor name is unknown or its type unsupported.
        """
        plan = self._plan(check_types=True)
        for info, hf_name, n_head, expert in plan:
            tensor = self._dequantize(info, expert)
            yield hf_name, (unpermute_rows(tensor, n_head).contiguous() if n_head else tensor)

    def iter_lazy(self):
        """(HF name, loaders/lazy.py GGUFTensor) for every weight: dequantized in part when read (a
        tensor-parallel rank's rows and columns), Q/K rows in HF order. Validates like iter_tensors."""
        from tokenmill.loaders.lazy import GGUFTensor
        for info, hf_name, n_head, expert in self._plan(check_types=True):
            yield hf_name, GGUFTensor(self._raw(info, expert), info.ggml_type, _shape(info, expert), n_head)

    def iter_raw(self) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
        """(HF name, ggml type name e.g. "Q4_1", HF logical shape, raw bytes) for every weight.

        raw: uint8 [*shape[:-1], row_bytes], a copy-on-write view of the mapped file (no copy made).
        Q/K rows are NOT un-permuted here: for llama/mistral files (see `needs_unpermute`), the
        caller must apply `unpermute_rows(raw, n_head)` to q_proj (num_attention_heads) and k_proj
        (num_key_value_heads) weights and biases. Any ggml type is yielded, supported or not.
        """
        for info, hf_name, _, expert in self._plan(check_types=False):
            yield hf_name, ggml_type_name(info.ggml_type), _shape(info, expert), self._raw(info, expert)

    def needs_unpermute(self, hf_name: str) -> int:
        """Heads to pass to `unpermute_rows` for this HF tensor name in iter_raw output; 0 if none."""
        config = self.hf_config()
        if self.header.metadata["general.architecture"] not in _PERMUTED_ARCHS:
            return 0
        if ".self_attn.q_proj." in hf_name:
            return config.num_attention_heads
        if ".self_attn.k_proj." in hf_name:
            return config.num_key_value_heads
        return 0

    def load_tokenizer(self, cache_dir: str | None = None) -> PreTrainedTokenizerFast:
        """Tokenizer with chat template from the GGUF metadata; see gguf_tokenizer for the cache."""
        return load_gguf_tokenizer(self.path, cache_dir)

    # -- internals -------------------------------------------------------------------------------

    def _plan(self, check_types: bool) -> list[tuple[TensorInfo, str, int, int | None]]:
        """[(tensor info, HF name, heads to un-permute or 0, expert index of a stacked MoE tensor or None)]
        for all weights, validated up front."""
        plan = []
        for info in self._sources():
            if info.name in _SKIPPED:
                continue
            hf_name = hf_tensor_name(info.name)
            if hf_name is None:
                raise GGUFError(f"{self.path}: tensor {info.name!r} has no Hugging Face name mapping "
                                f"for architecture {self.architecture!r}.")
            if check_types:
                self._check_dequantizable(info)
            experts = range(info.shape[0]) if "{e}" in hf_name else [None]
            for e in experts:
                name = self._arch_name(hf_name.replace("{e}", str(e)))
                plan.append((info, name, self.needs_unpermute(name), e))
        return plan

    def check_dequantizable(self, taken: set[str] = frozenset()) -> None:
        """GGUFError naming the first tensor whose ggml type cannot be dequantized, as iter_weights raises it,
        among the tensors but those (HF names) a quantization method takes as they are (`taken`)."""
        for info, hf_name, _, _ in self._plan(check_types=False):
            if hf_name not in taken:
                self._check_dequantizable(info)

    def _check_dequantizable(self, info) -> None:
        for part in getattr(info, "parts", (info,)):
            if not is_supported(part.ggml_type):
                raise GGUFError(f"{self.path}: tensor {part.name!r} has ggml type "
                                f"{ggml_type_name(part.ggml_type)}, which cannot be dequantized; "
                                f"supported: {', '.join(SUPPORTED_TYPES)}.")

    def _sources(self) -> list:
        """The file's tensors, with each layer's attn_k_b + attn_v_b (deepseek2) as one _MergedKVB."""
        tensors = self.header.tensors
        sources = []
        for name, info in tensors.items():
            match = _LAYER_RE.match(name)
            if match is None or match.group(2) not in _KV_B_PARTS:
                sources.append(info)
            elif match.group(2) == "attn_k_b":
                v_name = name.replace(".attn_k_b.", ".attn_v_b.")
                if v_name not in tensors:
                    raise GGUFError(f"{self.path}: tensor {name!r} has no {v_name!r} beside it.")
                sources.append(_MergedKVB(info, tensors[v_name]))
            elif name.replace(".attn_v_b.", ".attn_k_b.") not in tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} has no attn_k_b beside it.")
        return sources

    def _arch_name(self, hf_name: str) -> str:
        """HF Mixtral names its MoE block block_sparse_moe and its experts' projections w1 / w3 / w2."""
        if self.architecture != "mixtral" or ".mlp." not in hf_name:
            return hf_name
        for ours, theirs in _MIXTRAL_NAMES.items():
            hf_name = hf_name.replace(f".{ours}.", f".{theirs}.")
        return hf_name.replace(".mlp.", ".block_sparse_moe.")

    def _raw(self, info: TensorInfo, expert: int | None = None) -> np.ndarray:
        if isinstance(info, _MergedKVB):
            merged = merge_kv_b(self._dequantize(info.k_b), self._dequantize(info.v_b))
            return merged.numpy().view(np.uint8)          # F32 rows [H * (nope + v), rank * 4]
        try:
            row_bytes = row_nbytes(info.ggml_type, info.ggml_dims[0])
        except (KeyError, ValueError) as e:
            raise GGUFError(f"{self.path}: tensor {info.name!r} of ggml type {ggml_type_name(info.ggml_type)} "
                            f"with shape {info.shape} has no known byte layout ({e}).") from e
        n_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        start = self.header.data_start_bytes + info.offset_bytes
        end = start + n_rows * row_bytes
        if end > self.header.file_size_bytes:
            raise GGUFError(f"{self.path}: tensor {info.name!r} runs past the end of the file (truncated download?).")
        raw = self._data[start:end].reshape(*info.shape[:-1], row_bytes)
        return raw if expert is None else raw[expert]

    def _dequantize(self, info: TensorInfo, expert: int | None = None) -> torch.Tensor:
        if not is_supported(info.ggml_type):
            raise GGUFError(f"{self.path}: tensor {info.name!r} has unsupported ggml type "
                            f"{ggml_type_name(info.ggml_type)}; supported: {', '.join(SUPPORTED_TYPES)}.")
        return dequantize(self._raw(info, expert), info.ggml_type, _shape(info, expert))


class _MergedKVB:
    """DeepSeek's kv_b_proj.weight read from llama.cpp's split attn_k_b / attn_v_b: float32, merged when read
    (see loaders/gguf_deepseek.py)."""
    ggml_type = 0                                   # GGMLQuantizationType.F32: what _raw returns

    def __init__(self, k_b: TensorInfo, v_b: TensorInfo) -> None:
        self.k_b, self.v_b, self.parts = k_b, v_b, (k_b, v_b)
        self.name = k_b.name.replace(".attn_k_b.", ".attn_kv_b.")
        heads, rank, nope = k_b.shape
        self.shape = (heads * (nope + v_b.shape[1]), rank)


def _shape(info: TensorInfo, expert: int | None) -> tuple[int, ...]:
    """HF shape of the tensor, or of one expert's part of a stacked MoE tensor."""
    return tuple(info.shape) if expert is None else tuple(info.shape[1:])


def hf_tensor_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF checkpoint name, or None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer, _, rest = gguf_name.removeprefix("blk.").partition(".")
    if gguf_name.startswith("blk.") and rest in _WHOLE_LAYER_NAMES:
        return f"model.layers.{layer}.{_WHOLE_LAYER_NAMES[rest]}"
    match = _LAYER_RE.match(gguf_name)
    if match is None or (match.group(2) not in _LAYER_NAMES and match.group(2) not in _EXPERT_NAMES):
        return None
    layer, key, kind = match.groups()
    if key in _EXPERT_NAMES:                    # one HF tensor per expert: {e} filled in by the caller
        return f"model.layers.{layer}.mlp.experts.{{e}}.{_EXPERT_NAMES[key]}.{kind}"
    return f"model.layers.{layer}.{_LAYER_NAMES[key]}.{kind}"
