"""Shared fixtures: tiny random Hugging Face models (built with transformers, saved as safetensors
directories with the default model's tokenizer), so tests never need a model hub."""
from __future__ import annotations

import os

# torch's OpenMP threads spin while waiting by default; with the two cores shared by several test
# processes (the server tests start their own), spinning makes every op orders of magnitude slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

DEFAULT_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def default_tokenizer():
    from tokenmill.loaders.default_model import default_model_path
    from tokenmill.loaders.gguf import GGUFFile
    return GGUFFile(default_model_path()).load_tokenizer()


def build_tiny_model(out_dir: str, tokenizer, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A random tiny model of `arch` (llama | qwen2 | mistral) saved as a HF directory."""
    import transformers
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    kwargs = dict(DEFAULT_TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kwargs)).float().eval()
    with torch.no_grad():  # larger weights than the init default, so differences are not hidden by tiny logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            else:  # norm weights
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


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
    from tokenmill.layers import cpu_kernels
    cpu_kernels.load()
    yield


@pytest.fixture(autouse=True, scope="session")
def _small_torch_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
