"""GGUF loader on small files written here the way llama.cpp's convert_hf_to_gguf writes them."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.loaders.gguf import GGUFError, GGUFFile, permute_rows, unpermute_rows
from tokenmill.loaders.gguf_dequant import dequantize
from tokenmill.loaders.gguf_header import read_header

# HF -> GGUF names, written out independently of the loader's own table
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# byte offsets of the f16 scale fields in one block, to make random blocks finite
_F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
               T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, restated."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        state[name] = base + 0.05 * torch.randn(t.shape, generator=gen)
    return state


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes with a valid layout: [rows, row_bytes] uint8, f16 scales finite."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = rng.uniform(-0.01, 0.01, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block_size * type_size)


def encode(data: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return data.astype(np.float32)
    if qtype == T.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data.astype(np.float32), qtype)


def add_metadata(writer: gguf.GGUFWriter, config, name: str = "tiny") -> None:
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)


def write_gguf(path, arch: str, config, state: dict[str, torch.Tensor], qtype: T, permute: bool) -> dict:
    """Write `state` (HF names) like the converter; returns {hf_name: stored numpy array}."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, config)
    stored = {}
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = t.numpy()
        if permute and ".q_proj." in hf_name:
            data = converter_permute(data, config.num_attention_heads)
        if permute and ".k_proj." in hf_name:
            data = converter_permute(data, config.num_key_value_heads)
        stored[hf_name] = encode(data, qtype) if data.ndim == 2 else data.astype(np.float32)
        raw_dtype = qtype if stored[hf_name].dtype == np.uint8 else None
        writer.add_tensor(gguf_name(hf_name), stored[hf_name], raw_dtype=raw_dtype)
    _finish(writer)
    return stored


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False)
    return LlamaConfig(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def llama_untied():
    config = tiny_llama_config()
    return config, random_state(LlamaForCausalLM(config), seed=0)


def stored_as_hf(stored: np.ndarray, qtype: T, hf_name: str, config) -> torch.Tensor:
    """Reference: gguf.quants.dequantize of the written bytes, rows put back in HF order."""
    values = gguf.quants.dequantize(stored, qtype) if stored.dtype == np.uint8 else stored.astype(np.float32)
    if ".q_proj." in hf_name:
        values = unpermute_rows(values, config.num_attention_heads)
    if ".k_proj." in hf_name:
        values = unpermute_rows(values, config.num_key_value_heads)
    return torch.from_numpy(np.ascontiguousarray(values))


# relative Frobenius error allowed against the original weights, per storage type
_TOLERANCE = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1e-2, T.Q4_0: 0.2, T.Q4_1: 0.2}


@pytest.mark.parametrize("qtype", list(_TOLERANCE), ids=lambda q: q.name)
def test_llama_tensors_match_original(tmp_path, llama_untied, qtype):
    config, state = llama_untied
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, "llama", config, state, qtype, permute=True)
    loaded = dict(GGUFFile(str(path)).iter_tensors())
    assert set(loaded) == set(state)
    for name, original in state.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        reference = stored_as_hf(stored[name], qtype, name, config)
        assert torch.equal(got, reference), f"{name}: not bit-exact with gguf.quants.dequantize"
        rel_err = (got - original).norm() / original.norm()
        assert rel_err <= _TOLERANCE[qtype] if original.ndim == 2 else rel_err == 0, (name, rel_err)


def test_llama_config(tmp_path, llama_untied):
    config, state = llama_untied
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", config, state, T.F32, permute=True)
    got = GGUFFile(str(path)).hf_config()
    assert type(got) is LlamaConfig and got.architectures == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "rope_parameters"):
        assert getattr(got, key) == getattr(config, key), key
    assert got.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert got.tie_word_embeddings is False and got.attention_bias is False


def test_tied_embeddings(tmp_path):
    config = tiny_llama_config(tie_word_embeddings=True)
    state = random_state(LlamaForCausalLM(config), seed=1)
    path = tmp_path / "tied.gguf"
    write_gguf(path, "llama", config, state, T.Q8_0, permute=True)
    f = GGUFFile(str(path))
    assert f.hf_config().tie_word_embeddings is True
    names = {name for name, _ in f.iter_tensors()}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_qwen2_bias_and_no_permutation(tmp_path):
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    state = random_state(Qwen2ForCausalLM(config), seed=2)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, "qwen2", config, state, T.F32, permute=False)
    f = GGUFFile(str(path))
    got_config = f.hf_config()
    assert type(got_config) is Qwen2Config and got_config.architectures == ["Qwen2ForCausalLM"]
    assert got_config.attention_bias is True and got_config.tie_word_embeddings is True
    assert got_config.rope_parameters["rope_theta"] == 1e6
    loaded = dict(f.iter_tensors())
    assert set(loaded) == set(state) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name]), name


def test_iter_raw_unpermuted_by_caller(tmp_path, llama_untied):
    config, state = llama_untied
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", config, state, T.Q4_1, permute=True)
    f = GGUFFile(str(path))
    dequantized = dict(f.iter_tensors())
    for name, type_name, shape, raw in f.iter_raw():
        assert shape == tuple(state[name].shape), name
        assert type_name == ("Q4_1" if len(shape) == 2 else "F32"), name
        n_head = f.needs_unpermute(name)
        assert n_head == ({"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2], 0))
        rows = unpermute_rows(raw, n_head) if n_head else raw
        assert torch.equal(dequantize(np.ascontiguousarray(rows), T[type_name], shape), dequantized[name]), name


def test_permute_roundtrip_any_dtype():
    for t in (torch.arange(48 * 5).reshape(48, 5), torch.arange(48, dtype=torch.uint8), np.arange(96).reshape(48, 2)):
        back = unpermute_rows(permute_rows(t, 6), 6)
        assert (back == t).all()
    with pytest.raises(ValueError, match="multiple of 2"):
        unpermute_rows(torch.zeros(10, 2), 4)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16],
                         ids=lambda q: q.name)
def test_dequantize_bit_exact(qtype):
    rows, cols = 6, 512
    if qtype in (T.F16, T.BF16):
        raw = encode(np.random.default_rng(0).normal(size=(rows, cols)), T.F16)
        raw = raw.view(np.uint8) if qtype == T.F16 else gguf.quants.quantize(raw.astype(np.float32), T.BF16)
    else:
        raw = random_blocks(qtype, rows, cols)
    reference = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw.copy(), qtype, (rows, cols)).numpy()
    assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))


def write_random_blocks_file(path, qtypes: dict[str, T], extra: dict[str, np.ndarray] | None = None,
                             **config_overrides) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """A one-layer llama with rows of 256 values; 2-D weights are random blocks of the given types."""
    config = tiny_llama_config(**{**dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1), **config_overrides})
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, config)
    stored = {}
    for i, (hf_name, t) in enumerate(LlamaForCausalLM(config).state_dict().items()):
        if t.ndim == 1:
            stored[hf_name] = np.ones(t.shape, dtype=np.float32)
            writer.add_tensor(gguf_name(hf_name), stored[hf_name])
            continue
        qtype = qtypes.get(gguf_name(hf_name), qtypes["*"])
        stored[hf_name] = random_blocks(qtype, t.shape[0], t.shape[1], seed=i)
        writer.add_tensor(gguf_name(hf_name), stored[hf_name], raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    _finish(writer)
    return config, stored


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_k_quants_through_file(tmp_path, qtype):
    path = tmp_path / "kquant.gguf"
    config, stored = write_random_blocks_file(path, {"*": qtype})
    loaded = dict(GGUFFile(str(path)).iter_tensors())
    assert set(loaded) == set(stored)
    for name, raw in stored.items():
        assert torch.equal(loaded[name], stored_as_hf(raw, qtype, name, config)), name


def test_header_matches_gguf_reader(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_random_blocks_file(path, {"*": T.Q4_K, "blk.0.ffn_up.weight": T.Q6_K})
    header, reader = read_header(str(path)), gguf.GGUFReader(str(path))
    assert [t.name for t in reader.tensors] == list(header.tensors)
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert (info.ggml_type, info.ggml_dims) == (int(t.tensor_type), tuple(int(d) for d in t.shape))
        assert header.data_start_bytes + info.offset_bytes == t.data_offset
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert header.metadata[key] == pytest.approx(field.contents()), key


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """What convert_hf_to_gguf stores in rope_freqs.weight for Llama 3 rope scaling, restated."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            divisors.append(1.0)
        elif wavelen > old_ctx / low:
            divisors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


@pytest.mark.parametrize("factor,low,high,old_ctx", [(8.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor, low, high, old_ctx):
    theta, head_dim = 500000.0, 128
    divisors = llama3_divisors(theta, head_dim, factor, low, high, old_ctx)
    path = tmp_path / "llama3.gguf"
    write_random_blocks_file(path, {"*": T.Q4_K}, extra={"rope_freqs.weight": divisors},
                             rope_parameters={"rope_type": "default", "rope_theta": theta}, max_position_embeddings=131072)
    f = GGUFFile(str(path))
    config = f.hf_config()
    assert config.rope_parameters["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in {name for name, *_ in f.iter_raw()}
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = default / torch.from_numpy(divisors).double()
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-5, atol=0)


def test_error_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        GGUFFile(str(tmp_path / "missing.gguf"))


def test_error_not_gguf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a model file, just some text\n")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(str(path))


def test_error_truncated(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_random_blocks_file(path, {"*": T.Q8_0})
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(str(path))


def test_error_unsupported_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    write_random_blocks_file(path, {"*": T.Q8_0, "blk.0.ffn_down.weight": T.Q2_K})
    f = GGUFFile(str(path))
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_down\.weight.*Q2_K"):
        next(f.iter_tensors())  # validated before the first tensor is yielded
    assert dict((n, t) for n, t, _, _ in f.iter_raw())["model.layers.0.mlp.down_proj.weight"] == "Q2_K"


def test_error_unsupported_type_when_int4_takes_the_rest_directly(tmp_path, tiny_model_factory):
    """quantization="int4" takes Q4_1 blocks as they are and dequantizes the rest: a Q2_K tensor among them
    gets the float path's error, not a bare KeyError from the dequantizer."""
    from tokenmill import LLM
    path = tmp_path / "q4_1-q2k.gguf"
    write_random_blocks_file(path, {"*": T.Q4_1, "blk.0.ffn_down.weight": T.Q2_K})
    tokenizer = tiny_model_factory("llama")
    for quantization in (None, "int4"):
        with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_down\.weight' has ggml type Q2_K, which cannot "
                                            r"be dequantized; supported: F32, "):
            LLM(str(path), tokenizer=tokenizer, quantization=quantization, kv_cache_memory_bytes=1 << 22)


def test_error_unknown_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gptneox")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(writer)
    with pytest.raises(GGUFError, match="'gptneox'.*llama, mistral, qwen2"):
        GGUFFile(str(path))


def test_error_unknown_tensor_name(tmp_path):
    path = tmp_path / "fused.gguf"
    write_random_blocks_file(path, {"*": T.Q8_0}, extra={"blk.0.attn_qkv.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_qkv\.weight"):
        next(GGUFFile(str(path)).iter_tensors())


def test_mistral_named_llama_file(tmp_path):
    path = tmp_path / "mistral.gguf"
    config = tiny_llama_config()
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, config, name="Mistral 7B Instruct")
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    _finish(writer)
    got = GGUFFile(str(path)).hf_config()
    assert got.architectures == ["MistralForCausalLM"] and got.sliding_window is None
