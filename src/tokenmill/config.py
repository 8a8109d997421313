"""Engine configuration: one frozen dataclass per concern, built once from `EngineArgs`.

`EngineArgs` is what users pass (`LLM(**kwargs)`, CLI flags); `EngineConfig` is what the engine reads.
Derived values are properties; constructors do no I/O (loading the HF config happens in `create_engine_config`)
but EngineArgs' check that a local tokenizer path exists. EngineArgs and SpeculativeConfig check each value
against its field's type (check_type: a bool is no integer, an integer is a float).
"""
from __future__ import annotations

import argparse
import functools
import os
import typing
from dataclasses import dataclass, field, fields

import torch

from tokenmill.sampling_params import builtin_number

# the gated MLPs' activations (HF config hidden_act) tokenmill computes: act(gate) * up, as transformers'
# ACT2FN (silu = swish; gelu exact, with erf; gelu_pytorch_tanh the tanh approximation); layers/activation.py
HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (layers/moe/): which layers have them and how tokens are routed."""
    num_experts: int                 # routed experts per MoE layer
    top_k: int                       # experts per token
    expert_intermediate_size: int    # each routed expert's SwiGLU width
    sparse_layers: tuple[int, ...]   # layer indices whose MLP is MoE (the others are dense)
    scoring: str = "softmax"         # "softmax" (Mixtral, Qwen3-MoE) | "sigmoid" (DeepSeek-V3)
    renormalize: bool = True         # the k chosen weights are divided by their sum
    num_groups: int = 1              # DeepSeek-V3 grouped top-k: experts in n_group groups,
    topk_groups: int = 1             # tokens choose among the best topk_group groups only
    routed_scaling_factor: float = 1.0   # routed experts' weights times this
    num_shared_experts: int = 0      # DeepSeek: one always-on MLP of num_shared x expert width
    correction_bias: bool = False    # DeepSeek-V3: e_score_correction_bias biases the choice, not the weights
    router_bias: bool = False        # gpt-oss: the router's logits carry a bias
    expert_bias: bool = False        # gpt-oss: each expert's gate/up and down projections carry biases
    # the experts' activation over [gate | up]: one of HIDDEN_ACTS, act(gate) * up (the config's hidden_act;
    # "silu" is SwiGLU), or "clamped_swiglu" (gpt-oss: gate clamped above at swiglu_limit, up to
    # +-swiglu_limit, then (up + 1) * gate * sigmoid(alpha * gate))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.activation not in (*HIDDEN_ACTS, "clamped_swiglu"):
            raise ValueError(f"MoE expert activation must be one of {[*HIDDEN_ACTS, 'clamped_swiglu']}, "
                             f"got {self.activation!r}")
        if not 1 <= self.top_k <= self.num_experts or self.num_experts % self.num_groups \
                or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"MoE routing: need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts}), "
                             f"num_experts divisible by n_group ({self.num_groups}) and 1 <= topk_group "
                             f"({self.topk_groups}) <= n_group")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: the cache holds one latent per token (kv_lora_rank values
    plus the shared rope key, qk_rope_head_dim values) instead of K and V per head."""
    q_lora_rank: int | None          # None: q_proj is one matrix (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True     # rope dims stored as interleaved pairs (HF rope_interleave)

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # e.g. "LlamaForCausalLM": the model registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None    # HF rope parameters, e.g. {"rope_type": "llama3", "factor": 8, ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v projections carry a bias (Qwen2, Llama's attention_bias; DeepSeek: q_a, kv_a)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    moe: MoEConfig | None = None     # None: every MLP is dense
    mla: MLAConfig | None = None     # None: grouped-query attention with K/V heads
    qk_norm: bool = False            # RMSNorm on each q and k head before rotary (Qwen3)
    num_mtp_layers: int = 0          # DeepSeek's multi-token-prediction layers after the main ones
    kv_cache_dtype: torch.dtype | None = None   # None: dtype; bfloat16; float8_e4m3fn: the FP8 cache (fp8_kv.py)
    # tokens each layer attends back to (its own included), None: the whole context (gpt-oss alternates
    # sliding layers of 128 with full ones; Mistral, Mixtral, Qwen3-MoE slide on every layer, Qwen2 on the
    # layers from max_window_layers on); () for every layer full
    layer_windows: tuple[int | None, ...] = ()
    attention_out_bias: bool = False # o_proj carries a bias (HF attention_bias of Llama, Qwen3-MoE, gpt-oss,
                                     # DeepSeek-V3; never Qwen2's, whose bias is q/k/v only)
    mlp_bias: bool = False           # the dense MLPs' gate/up and down projections carry biases (Llama mlp_bias)
    hidden_act: str = "silu"         # the dense MLPs' and experts' act in act(gate) * up: one of HIDDEN_ACTS

    @classmethod
    def from_hf(cls, hf_config, dtype: torch.dtype = torch.float32) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            archs = [_arch_from_model_type(getattr(hf_config, "model_type", None))]
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=_rope_theta(hf_config),
            rope_scaling=_rope_scaling(hf_config),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=_attention_bias(hf_config, archs[0]),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=_as_tuple(getattr(hf_config, "eos_token_id", None)),
            dtype=dtype,
            moe=_moe_config(hf_config, archs[0]),
            mla=_mla_config(hf_config),
            qk_norm=archs[0].startswith("Qwen3"),
            num_mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
            if archs[0].startswith("DeepseekV3") else 0,
            layer_windows=_layer_windows(hf_config, archs[0]),
            attention_out_bias=_attention_out_bias(hf_config, archs[0]),
            mlp_bias=archs[0].startswith("Llama") and bool(getattr(hf_config, "mlp_bias", False)),
            hidden_act=_hidden_act(hf_config, archs[0]),
        )

    def __post_init__(self) -> None:
        _check_hidden_act(self.hidden_act)

    def window(self, layer_index: int) -> int | None:
        """Tokens layer `layer_index` attends back to, its own included; None: all of them."""
        return self.layer_windows[layer_index] if self.layer_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache of every layer for one token, in bytes: K and V per kv head, or MLA's latent."""
        per_layer = self.mla.latent_dim if self.mla is not None else 2 * self.kv_size
        return self.num_layers * per_layer * self.cache_dtype.itemsize

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV cache stores: the compute dtype, bfloat16 with kv_cache_dtype="bfloat16", or float8_e4m3fn
        with kv_cache_dtype="fp8"."""
        return self.kv_cache_dtype or self.dtype

    def kv_bytes_per_token_all_ranks(self, tensor_parallel_size: int) -> int:
        """The cache bytes one token takes summed over the tensor-parallel ranks: K/V heads are split
        across them, MLA's latent is whole on every rank."""
        return self.kv_bytes_per_token * (tensor_parallel_size if self.mla is not None else 1)


def _moe_config(hf, architecture: str) -> MoEConfig | None:
    """The HF config's MoE fields by family (Mixtral, Qwen3-MoE, DeepSeek-V3), or None for dense models."""
    n_layers = hf.num_hidden_layers
    if architecture.startswith("Mixtral"):
        return MoEConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, tuple(range(n_layers)),
                         activation=_hidden_act(hf, architecture))
    if architecture.startswith("Qwen3Moe"):
        skip, step = set(getattr(hf, "mlp_only_layers", None) or ()), getattr(hf, "decoder_sparse_step", 1) or 1
        layers = tuple(i for i in range(n_layers) if i not in skip and (i + 1) % step == 0)
        return MoEConfig(hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, layers,
                         renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                         activation=_hidden_act(hf, architecture))
    if architecture.startswith("GptOss"):     # softmax over the top-k logits = renormalized top-k softmax
        return MoEConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, tuple(range(n_layers)),
                         router_bias=True, expert_bias=True, activation="clamped_swiglu",
                         swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                         swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)))
    if architecture.startswith("DeepseekV3"):
        first_moe = getattr(hf, "first_k_dense_replace", 0) or 0
        return MoEConfig(hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                         tuple(range(first_moe, n_layers)), scoring="sigmoid",
                         renormalize=bool(getattr(hf, "norm_topk_prob", True)),
                         num_groups=getattr(hf, "n_group", 1) or 1, topk_groups=getattr(hf, "topk_group", 1) or 1,
                         routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0)),
                         num_shared_experts=getattr(hf, "n_shared_experts", 0) or 0, correction_bias=True,
                         activation=_hidden_act(hf, architecture))
    return None


def _layer_windows(hf, architecture: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it (a query at p reads p - window + 1 .. p):
    - Mistral, Mixtral: every layer, when sliding_window is set;
    - Qwen3-MoE: every layer, with use_sliding_window;
    - Qwen2: with use_sliding_window, the layers layer_types names "sliding_attention" (by default those
      from max_window_layers on);
    - gpt-oss: the layers layer_types names (by default every other one, from layer 0).
    () when no layer slides (Llama and DeepSeek-V3 never do)."""
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    if architecture.startswith(("Qwen2", "Qwen3Moe")) and not getattr(hf, "use_sliding_window", False):
        window = None                # transformers sets sliding_window to None without use_sliding_window
    if not window or not architecture.startswith(("Mistral", "Mixtral", "Qwen2", "Qwen3Moe", "GptOss")):
        return ()
    if architecture.startswith(("Mistral", "Mixtral", "Qwen3Moe")):
        return (int(window),) * n
    types = getattr(hf, "layer_types", None) or _default_layer_types(hf, architecture)
    if len(types) != n:
        raise ValueError(f"model config layer_types names {len(types)} layers, expected num_hidden_layers = {n}")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _default_layer_types(hf, architecture: str) -> list[str]:
    """transformers' layer_types where a config gives none: Qwen2 slides from max_window_layers on, gpt-oss
    on every other layer from layer 0."""
    n = hf.num_hidden_layers
    if architecture.startswith("Qwen2"):
        first = getattr(hf, "max_window_layers", None)
        first = n if first is None else first
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


def _hidden_act(hf, architecture: str) -> str:
    """The gated MLPs' activation (HF hidden_act), checked; gpt-oss's experts have their own (MoEConfig
    clamped_swiglu) and its config's hidden_act is unused."""
    if architecture.startswith("GptOss"):
        return "silu"
    act = getattr(hf, "hidden_act", None) or "silu"
    _check_hidden_act(act)
    return act


def _check_hidden_act(act: str) -> None:
    if act not in HIDDEN_ACTS:
        raise ValueError(f"model config hidden_act {act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")


def _attention_out_bias(hf, architecture: str) -> bool:
    """o_proj's bias as transformers builds it: attention_bias for Llama, Qwen3-MoE, gpt-oss and DeepSeek-V3;
    never for Qwen2 (its bias is q/k/v only), Mistral or Mixtral."""
    if architecture.startswith(("Llama", "Qwen3Moe", "GptOss", "DeepseekV3")):
        return bool(getattr(hf, "attention_bias", False))
    return False


def _mla_config(hf) -> MLAConfig | None:
    if getattr(hf, "kv_lora_rank", None) is None:
        return None
    return MLAConfig(getattr(hf, "q_lora_rank", None), hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                     hf.v_head_dim, bool(getattr(hf, "rope_interleave", True)))


def _arch_from_model_type(model_type: str | None) -> str:
    known = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
             "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
    if model_type not in known:
        raise ValueError(f"model config has no 'architectures' and model_type {model_type!r} is not one of "
                         f"{sorted(known)}")
    return known[model_type]


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(hf_config, "rope_theta", None) or 10000.0)


def _rope_scaling(hf_config) -> dict | None:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    return None if kind == "default" else dict(params, rope_type=kind)


def _attention_bias(hf_config, architecture: str) -> bool:
    if architecture.startswith("Qwen2"):
        return True
    return bool(getattr(hf_config, "attention_bias", False))


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)


# kv_cache_dtype option -> what the cache stores (None: the model's dtype). bfloat16: two bytes a value, each
# key and value rounded to nearest even as written and read back exactly as float32 (llama.cpp's default cache is
# float16, vLLM's the model's bfloat16); FP8 as layers/attention/fp8_kv.py.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(name: str) -> torch.dtype | None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected one of {sorted(KV_CACHE_DTYPES)} "
                         "('auto': the model's dtype; 'bfloat16': two bytes a value; 'fp8' = 'fp8_e4m3': one byte "
                         "a value with per-head scales)")
    return KV_CACHE_DTYPES[name]


# how a type-check error names what a field expected
_TYPE_NAMES = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string",
               dict: "a JSON object (dict)", type(None): "null (None)"}


@functools.cache
def _field_types(cls) -> dict[str, tuple[type, ...]]:
    """Each field of dataclass `cls` -> the classes its annotation admits (`int | None` -> (int, NoneType))."""
    hints = typing.get_type_hints(cls)
    return {f.name: tuple(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if isinstance(t, type))
            for f in fields(cls)}


def _plain_value(value):
    """A path object as its str, a numpy (or other numbers.Integral / Real) scalar as int / float
    (sampling_params.builtin_number); else value itself. Callers pass pathlib paths and numpy numbers; fields
    hold plain values."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return builtin_number(value)


def _has_type(value, allowed: tuple[type, ...]) -> bool:
    """isinstance, except that a bool is neither an integer nor a number, and an integer is a float."""
    if isinstance(value, bool):
        return bool in allowed
    return isinstance(value, allowed) or (isinstance(value, int) and float in allowed)


def check_type(name: str, value, allowed: tuple[type, ...], prefix: str = "") -> None:
    """ValueError naming the field, the types it takes and the value, unless `value` is one of `allowed`."""
    if not _has_type(value, allowed):
        expected = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in allowed)
        raise ValueError(f"{prefix}{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_field_types(obj, prefix: str = "") -> None:
    """Every field of dataclass instance `obj` against its annotation (check_type)."""
    for name, allowed in _field_types(type(obj)).items():
        check_type(name, getattr(obj, name), allowed, prefix)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                     # tokens per KV block
    num_blocks: int = 0                      # 0: sized by the platform after the weights are loaded
    enable_prefix_caching: bool = True
    memory_bytes: int | None = None          # KV pool size in bytes; overrides the two fractions
    memory_fraction: float = 0.25            # CPU: of the memory available when the pool is sized
    gpu_memory_utilization: float = 0.9      # GPU: of the device's memory, for weights + KV + activations

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.memory_bytes}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {self.memory_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256                  # running requests per step
    max_num_batched_tokens: int = 2048       # token budget per step (decode tokens + prefill chunks)
    max_model_len: int = 8192                # prompt + output tokens per request
    long_prefill_token_threshold: int = 0    # 0: a prefill chunk may use the whole budget
    policy: str = "fcfs"                     # core/policy.py POLICIES: "fcfs" or "slo"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_seqs} and {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        from tokenmill.core.policy import policy_names
        if self.policy not in policy_names():
            raise ValueError(f"unknown scheduling policy {self.policy!r}; expected one of {policy_names()}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: a dict {"method": ..., "num_speculative_tokens": k, ...} (or its JSON)."""
    method: str                              # spec/ PROPOSERS: "ngram" | "mtp" | "draft_model"
    num_speculative_tokens: int              # k: the most draft tokens per request per step
    model: str | None = None                 # mtp: a `tokenmill train-mtp` head's directory (None: the
                                             # checkpoint's own MTP layers); draft_model: the draft model
                                             # (None or "self": the target's first draft_num_layers layers)
    draft_num_layers: int | None = None      # draft_model self-speculation: layers of the target it runs
    # ngram: the shortest and longest suffix looked up; as in vLLM, one given alone sets the other to its
    # value; neither: 1 and 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True                    # k per step from acceptance and the step-time model (False: k)
    # mtp: drafts among the N tokens the head's training text used most (spec/draft_vocab.py; lossless, a
    # draft is only a guess); None: the head's own default (train-mtp writes one), 0: the whole vocabulary
    draft_vocab_size: int | None = None
    # "strict": lossless. "relaxed" (greedy requests, LOSSY, TensorRT-LLM's relaxed acceptance): a draft is
    # also accepted when it is among the target's top relaxed_top_n and its probability is within
    # relaxed_delta of the best one's
    acceptance: str = "strict"
    relaxed_top_n: int = 3
    relaxed_delta: float = 0.1

    def __post_init__(self) -> None:
        from tokenmill.spec import PROPOSERS
        check_field_types(self, "speculative_config: ")
        self._fill_prompt_lookup()
        if self.method not in PROPOSERS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; supported: {sorted(PROPOSERS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer in [1, 16], got "
                             f"{self.num_speculative_tokens!r}")
        if self.acceptance not in ("strict", "relaxed"):
            raise ValueError(f"speculative_config: acceptance must be 'strict' or 'relaxed', got {self.acceptance!r}")
        if not isinstance(self.relaxed_top_n, int) or self.relaxed_top_n < 1 or not 0.0 <= self.relaxed_delta <= 1.0:
            raise ValueError("speculative_config: relaxed_top_n must be an integer >= 1 and relaxed_delta in [0, 1]")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or isinstance(self.draft_vocab_size, bool) or self.draft_vocab_size < 0):
            raise ValueError("speculative_config: draft_vocab_size must be an integer >= 0 (0: the whole vocabulary), "
                             f"got {self.draft_vocab_size!r}")
        if self.draft_vocab_size is not None and self.method != "mtp":
            raise ValueError(f"speculative_config: draft_vocab_size applies to method 'mtp' only, not {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def _fill_prompt_lookup(self) -> None:
        """vLLM's rule: prompt_lookup_min alone sets prompt_lookup_max to it and the other way round."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = 1, 4
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON object string -> SpeculativeConfig (or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; expected some of {sorted(known)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise ValueError(f"speculative_config: missing {missing}")
        return cls(**value)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1            # ranks one model is split across (column/row-parallel layers)
    data_parallel_size: int = 1              # independent engine replicas
    distributed_executor_backend: str = "uni"   # "uni" (in process) | "mp" (a worker process per rank)
    replicas_sharing_host: int = 1           # engine replicas on this machine (their CPU KV budgets split)
    ray_address: str | None = None           # ray: the cluster to join ("auto", "ip:port"); None: start one here
    enable_expert_parallel: bool = False     # MoE: whole experts split over the tensor-parallel ranks,
                                             # tokens moved by all-to-all (else each expert split across them)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        from tokenmill.executor import EXECUTORS
        if self.distributed_executor_backend not in EXECUTORS:
            raise ValueError(f"unknown distributed_executor_backend {self.distributed_executor_backend!r}; "
                             f"expected one of {sorted(EXECUTORS)}")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError("tensor_parallel_size > 1 needs a worker process per rank: "
                             "distributed_executor_backend='mp' or 'ray'")

    @property
    def world_size(self) -> int:
        """Ranks under one engine core (each replica has its own)."""
        return self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0
    device: str = "cpu"                      # resolved: "cpu" or "cuda:N" (platforms/)
    attention_backend: str = "auto"          # "auto": the platform's default
    quantization: str | None = None          # None (checkpoint dtype), "int8", "int4", "w8a8"
    native_decode_layers: bool = True        # small decode steps: one native call per layer (decode_layer.cpp)
    greedy_screen: bool = True               # greedy steps skip the float32 logits (layers/greedy_head.py)
    enforce_eager: bool = False              # True: no CUDA graphs
    cuda_graph_max_batch: int = 256          # largest decode batch captured as a CUDA graph
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    num_threads: int | None = None           # CPU threads for the model: per rank in worker processes
    speculative: SpeculativeConfig | None = None   # None: one token per request per step
    checkpoint_quant: object | None = None   # quant/prequantized.py CheckpointQuant of a pre-quantized checkpoint


# the namespace attribute listing the engine flags the command line gave (_Given, _GivenConst, _GivenBool):
# those override a --config file, whatever their value
GIVEN = "engine_flags_given"


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, GIVEN, tuple(sorted({*getattr(namespace, GIVEN, ()), dest})))


class _Given(argparse.Action):
    """argparse's "store", the flag noted as given."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _GivenConst(argparse.Action):
    """argparse's "store_true" / "store_false", the flag noted as given."""

    def __init__(self, option_strings, dest, const, default=None, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const)
        _note_given(namespace, self.dest)


class _GivenBool(argparse.BooleanOptionalAction):
    """--flag / --no-flag, the flag noted as given."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def _add_flag(group, *names, action=None, **kwargs) -> None:
    """group.add_argument with the actions above ("store_true"/"store_false" become _GivenConst)."""
    if action in ("store_true", "store_false"):
        kwargs.setdefault("default", action == "store_false")
        action, kwargs["const"] = _GivenConst, action == "store_true"
    group.add_argument(*names, action=action or _Given, **kwargs)


def _flags_given(ns: argparse.Namespace) -> set[str]:
    """The engine flags the command line gave; for a namespace that EngineArgs.add_cli_args' parser did not
    make, those whose value is not the field's default."""
    if hasattr(ns, GIVEN):
        return set(getattr(ns, GIVEN))
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    return {k for k, v in vars(ns).items() if k in defaults and v != defaults[k]}


@dataclass
class EngineArgs:
    """User-facing engine options (LLM(**kwargs) and CLI flags share these names)."""
    model: str | None = None                 # HF directory or .gguf file; None: the default model
    tokenizer: str | None = None             # defaults to the model's own
    device: str = "auto"                     # "auto" (CUDA when torch sees a GPU) | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                      # "auto": the platform's (float32 on CPU, bfloat16 on CUDA)
    max_model_len: int | None = None         # >= 1; None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None # KV pool size; overrides the fraction
    kv_cache_memory_fraction: float = 0.25   # CPU: of currently available memory
    gpu_memory_utilization: float = 0.9      # GPU: fraction of the device for weights, KV cache, activations
    kv_cache_dtype: str = "auto"             # "auto": the model's dtype | "bfloat16" | "fp8" (= "fp8_e4m3")
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0    # largest prefill chunk per request per step; 0: the budget
    scheduling_policy: str = "fcfs"          # "fcfs" | "slo" (steps sized to the requests' latency targets)
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"          # "auto" | "cpu" | "reference" | "triton" (the CUDA path's)
    num_threads: int | None = None           # torch intra-op threads, >= 1; None: leave as is
    quantization: str | None = None          # weight quantization of every linear layer: int8 | int4 | w8a8 | fp8
                                             # | nvfp4 | mxfp4
    native_decode_layers: bool = True        # False: decode steps run the per-op Python path (comparison)
    greedy_screen: bool = True               # False: greedy steps compute every float32 logit (comparison)
    enforce_eager: bool = False              # True: no CUDA graphs (every step eager)
    cuda_graph_max_batch: int = 256          # decode batches up to this size replay captured graphs
    tensor_parallel_size: int = 1            # ranks one model is split across
    data_parallel_size: int = 1              # engine replicas, each in its own process with its own model
    distributed_executor_backend: str | None = None   # "uni" | "mp" | "ray"; None: "mp" when tensor parallel
    ray_address: str | None = None           # ray: an existing cluster ("auto", "ip:6379"); None: a local one
    speculative_config: dict | str | SpeculativeConfig | None = None   # {"method": "ngram", ...} or its JSON
    enable_expert_parallel: bool = False     # MoE experts sharded over the tensor-parallel ranks (all-to-all)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            plain = _plain_value(value)
            if plain is not value:
                object.__setattr__(self, name, plain)
            check_engine_arg(name, plain)
        unset = {"max_model_len": "the model's max_position_embeddings", "num_threads": "torch's thread count"}
        for name, meaning in unset.items():
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1 (or None: {meaning}), got {getattr(self, name)}")
        _check_tokenizer_path(self.tokenizer)

    def parallel_config(self) -> ParallelConfig:
        backend = self.distributed_executor_backend or ("mp" if self.tensor_parallel_size > 1 else "uni")
        return ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, backend,
                              ray_address=self.ray_address, enable_expert_parallel=self.enable_expert_parallel)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        parser.set_defaults(**{GIVEN: ()})
        add = functools.partial(_add_flag, g)
        add("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
        add("--tokenizer", default=None)
        add("--device", default="auto",
            help="auto (CUDA when torch sees a GPU, else the CPU) | cpu | cuda | cuda:N")
        add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
            help="compute dtype (auto: float32 on the CPU, bfloat16 on CUDA)")
        add("--max-model-len", type=int, default=None,
            help="prompt + output tokens per request, >= 1 (default: the model's max_position_embeddings)")
        add("--block-size", type=int, default=16)
        add("--kv-cache-memory-bytes", type=int, default=None)
        add("--kv-cache-memory-fraction", type=float, default=0.25,
            help="CPU: the KV pool's share of the memory available after loading")
        add("--gpu-memory-utilization", type=float, default=0.9,
            help="GPU: the share of the device's memory for weights, KV cache and activations")
        add("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
            help="KV cache storage: auto (the model's dtype), bfloat16 (two bytes a value, rounded to nearest "
                 "even) or fp8 (E4M3 with per-head scales from the checkpoint or calibrated on the first tokens)")
        add("--max-num-seqs", type=int, default=256)
        add("--max-num-batched-tokens", type=int, default=2048)
        add("--long-prefill-token-threshold", type=int, default=0,
            help="largest prefill chunk one request takes per step (0: the whole token budget)")
        g.add_argument("--config", default=None, metavar="FILE",
                       help="engine settings from a config file (as `tokenmill tune` writes); the engine flags "
                            "given on the command line override it")
        from tokenmill.core.policy import policy_names
        add("--scheduling-policy", default="fcfs", choices=policy_names(),
            help="fcfs: arrival order, fixed limits; slo: each step sized by the step-time model "
                 "to the requests' TPOT targets, admission by TTFT deadline")
        add("--enable-prefix-caching", action=_GivenBool, default=True,
            help="reuse the KV blocks of prompt prefixes seen before (MLPerf-style runs turn it off)")
        add("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
            help="the same as --no-enable-prefix-caching")
        add("--seed", type=int, default=0)
        add("--attention-backend", default="auto", choices=["auto", "cpu", "reference", "triton"],
            help="auto: the platform's (cpu on the CPU, triton on CUDA)")
        add("--num-threads", type=int, default=None,
            help="torch intra-op threads for the model, >= 1 (default: torch's count, left as it is)")
        add("--quantization", default=None, choices=["int8", "int4", "w8a8", "fp8", "nvfp4", "mxfp4"],
            help="weight quantization of every linear layer (default: none, fp32; a pre-quantized "
                 "FP8 checkpoint: fp8)")
        add("--no-native-decode-layers", dest="native_decode_layers", action="store_false",
            help="run small decode steps op by op in Python instead of one native call per layer")
        add("--no-greedy-screen", dest="greedy_screen", action="store_false",
            help="greedy steps compute all float32 logits instead of an int8 screen of the "
                 "vocabulary with exact rechecks (same tokens)")
        add("--enforce-eager", action="store_true", help="CUDA: run every step eagerly (no graphs)")
        add("--tensor-parallel-size", "-tp", type=int, default=1,
            help="ranks the model is split across (one worker process each; CPU threads are split)")
        add("--data-parallel-size", "-dp", type=int, default=1)
        add("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
            help="uni: the model in the engine's process; mp: a worker process per rank; ray: Ray "
                 "actors placed by a cluster (default: mp when tensor parallel)")
        add("--speculative-config", default=None, metavar="JSON",
            help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        add("--enable-expert-parallel", action="store_true",
            help="MoE models: whole experts split over the tensor-parallel ranks, tokens dispatched "
                 "and combined by all-to-all (default: every expert split across the ranks)")
        add("--ray-address", default=None,
            help="ray: the cluster to join (auto, or ip:port of `ray start --head`); default: a local one")
        add("--cuda-graph-max-batch", type=int, default=256,
            help="CUDA: the largest decode batch captured as a graph (larger steps run eagerly)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The engine flags of `ns`; with --config, the file's values under the flags the command line gave."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        if getattr(ns, "config", None):
            return cls.from_file(ns.config, **{k: v for k, v in values.items() if k in _flags_given(ns)})
        return cls(**values)

    @classmethod
    def from_file(cls, path: str, **overrides) -> "EngineArgs":
        """A config file's engine_args (config_file.py), with overrides on top."""
        from tokenmill.config_file import read_engine_args
        return cls(**{**read_engine_args(path), **overrides})

    def torch_dtype(self, platform_default: torch.dtype) -> torch.dtype:
        """The compute dtype; "auto" is the platform's default."""
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype == "auto":
            return platform_default
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(dtypes)}, got {self.dtype!r}")
        return dtypes[self.dtype]


def check_engine_arg(name: str, value) -> None:
    """One EngineArgs field's value against the field's type (ValueError naming both); speculative_config
    also through SpeculativeConfig.parse."""
    check_type(name, value, _field_types(EngineArgs)[name])
    if name == "speculative_config":
        SpeculativeConfig.parse(value)


def _check_tokenizer_path(path: str | None) -> None:
    """A tokenizer given as a local path (absolute, ./, ../ or ~) must exist, as the model's path must;
    other names are left to the tokenizer's loader."""
    if path and (os.path.isabs(path) or path.startswith((".", "~"))) and not os.path.exists(os.path.expanduser(path)):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist (expected a Hugging Face tokenizer "
                                "directory; tokenizers are not downloaded)")
