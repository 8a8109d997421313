"""Shared fixtures: tiny random Hugging Face models (built with transformers, saved as safetensors
directories with the default model's tokenizer), so tests never need a model hub."""
from __future__ import annotations

import os

# torch's OpenMP threads spin while waiting by default; with the two cores shared by several test
# processes (the server tests start their own), spinning makes every op orders of magnitude slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import time

import pytest
import torch

# Without a GPU, Triton kernels run only under its interpreter, a mode read when triton is first imported:
# set here, before any test module (or a library it imports) imports triton, so the order the modules are
# collected in does not decide it (a module that set it itself came too late after another imported triton)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
# per architecture, on top of DEFAULT_TINY (DeepSeek-V3: its HF tester's kind of shapes: a latent of 16,
# 8 routed experts in 4 groups, one shared expert, the first layer dense)
ARCH_TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                      head_dim=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # gpt-oss: a window of 4 on the first layer, full attention on the second
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, rope_interleave=True),
}


def process_ended_within(pid: int, timeout_s: float) -> bool:
    """Whether the process has ended (gone, or a zombie not yet reaped: two threads of a parent may race to
    reap it, and multiprocessing's is_alive() can read a child reaped by the other as alive) in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and "Z" in line.split()[1] for line in f):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer; where its package is not installed (a device machine, which reaches
    no registry), a word-level stand-in of the same vocabulary size, enough for tests of token ids."""
    try:
        from tokenmill.loaders.default_model import default_model_path
        path = default_model_path()
    except Exception:  # noqa: BLE001 - any failure to find the package means: not installed here
        return _stand_in_tokenizer()
    from tokenmill.loaders.gguf import GGUFFile
    return GGUFFile(path).load_tokenizer()


def _stand_in_tokenizer(vocab_size: int = 49152):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tiny_model(out_dir: str, tokenizer, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A random tiny model of `arch` (llama | qwen2 | mistral | mixtral | qwen3_moe | deepseek_v3 | gpt_oss)
    saved as a HF directory."""
    import transformers
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
           "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}[arch]
    kwargs = dict(DEFAULT_TINY, **ARCH_TINY.get(arch, {}), vocab_size=len(tokenizer),
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kwargs)).float().eval()
    with torch.no_grad():  # larger weights than the init default, so differences are not hidden by tiny logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:                      # matrices, and MoE experts stacked [E, out, in]
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            else:  # norm weights
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def add_mtp_layer(model_dir: str, seed: int = 1) -> None:
    """Give a tiny DeepSeek-V3 directory one MTP layer, model.layers.{num_hidden_layers}.*, as DeepSeek
    ships it (transformers saves none): a decoder layer of a deeper random model of the same config (its
    MoE experts in checkpoint names), random enorm / hnorm / eh_proj / shared_head.norm, and copies of
    the embedding and head, in a shard of its own."""
    import json
    import tempfile
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    with tempfile.TemporaryDirectory() as deeper:
        torch.manual_seed(seed)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**cfg, "num_hidden_layers": n + 1}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 0.08) if p.dim() >= 2 else p.copy_(1 + 0.1 * torch.randn_like(p))
        model.save_pretrained(deeper)
        prefix = f"model.layers.{n}."
        with safe_open(os.path.join(deeper, "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        tensors[prefix + "embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
        tensors[prefix + "shared_head.head.weight"] = f.get_tensor("lm_head.weight")
    g = torch.Generator().manual_seed(seed)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.08
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(model_dir, "model-mtp.safetensors"))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_tokenizer):
    made: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items(), key=lambda kv: kv[0])))
        key = (arch, repr(key))
        if key not in made:
            out = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            made[key] = build_tiny_model(out, default_tokenizer, arch, **overrides)
        return made[key]
    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(autouse=True, scope="session")
def _native_kernels_built():
    """Build (or load) the native kernels once, in this process, before any test starts a server: a server
    process that had to build them itself (tens of seconds on 2 cores) could miss its start-up deadline."""
    from tokenmill.platforms import cpu_native
    cpu_native.load()
    yield


@pytest.fixture(autouse=True, scope="session")
def _small_torch_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped, with the reason, where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
