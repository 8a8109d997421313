"""Decode steps run one native call per decoder layer (csrc/decode_layer.cpp): the same kernels as the
per-op path, so the same tokens and (to float rounding) the same log-probabilities. Every step here runs the
tile kernels (float32 up to 128 rows, int8/int4 at any size) or FP8's grouped GEMM; float32's large-step
kernel (oneDNN, what UnquantizedMethod.apply runs) is checked at 17 and 40 rows by forcing a smaller limit."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.platforms import cpu_native
from tokenmill.quant import tile_kernels

# The native decode layers chain the tile kernels, which only AVX-512 VNNI builds have.
pytestmark = pytest.mark.skipif(tile_kernels.kernels() is None,
                                reason="needs the tile kernels (an AVX-512 VNNI CPU and a compiler)")

_rng = random.Random(0)
PROMPTS = [[11, 220, 4890, 17, 9, 300, 5], [7, 8, 9], [1000, 2000, 3000, 4000, 5000]] + \
    [[_rng.randrange(10, 5000) for _ in range(_rng.randrange(1, 12))] for _ in range(17)]


def run(model_dir: str, mode: str | None, native: bool, prompts, kv_cache_dtype: str = "auto"):
    llm = LLM(model_dir, quantization=mode, native_decode_layers=native, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 23, block_size=4, kv_cache_dtype=kv_cache_dtype)
    program = llm.engine.core.runner.fused_decode          # platforms/cpu_decode.py NativeDecodeProgram
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    expect_native = native and mode != "w8a8"
    assert (program.steps == 7) if expect_native else (program is None)   # 8 tokens: 7 decodes
    bound = program is not None
    return bound, [(o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("mode", [None, "int8", "int4", "fp8"])
@pytest.mark.parametrize("arch,overrides", [("llama", dict(tie_word_embeddings=True)),
                                            ("qwen2", dict(tie_word_embeddings=False))])   # qkv bias
@pytest.mark.parametrize("batch", [1, 3, 20])
def test_native_layers_match_the_per_op_path(tiny_model_factory, mode, arch, overrides, batch):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = PROMPTS[:batch]
    bound, native = run(model_dir, mode, True, prompts)
    unbound, per_op = run(model_dir, mode, False, prompts)
    assert bound and not unbound
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(native, per_op):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


@pytest.mark.parametrize("mode", [None, "int4"])
@pytest.mark.parametrize("batch", [1, 20])
def test_an_fp8_kv_cache_runs_the_native_layers_as_the_per_op_path(tiny_model_factory, mode, batch):
    """The native layers write the FP8 codes (bitwise fp8_kv.quantize) and read them in the same kernel as the
    per-op path, under the scales the first prefill calibrated."""
    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    bound, native = run(model_dir, mode, True, PROMPTS[:batch], kv_cache_dtype="fp8")
    unbound, per_op = run(model_dir, mode, False, PROMPTS[:batch], kv_cache_dtype="fp8")
    assert bound and not unbound
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(native, per_op):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


@pytest.mark.parametrize("mode", [None, "int8", "fp8"])
def test_biased_o_proj_and_mlp_run_in_the_native_layers(tiny_model_factory, mode):
    """Llama's attention_bias (o_proj's bias too) and mlp_bias (gate/up and down): every DecodeLinear adds its
    bias as Linear.forward does."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    bound, native = run(model_dir, mode, True, PROMPTS[:3])
    unbound, per_op = run(model_dir, mode, False, PROMPTS[:3])
    assert bound and not unbound
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(native, per_op):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


@pytest.mark.parametrize("arch,overrides", [("llama", dict(hidden_act="gelu")),
                                            ("mistral", dict(sliding_window=4)),
                                            ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                                           max_window_layers=1))])
def test_other_activations_and_sliding_windows_keep_the_per_op_path(tiny_model_factory, arch, overrides):
    """The native layers compute SwiGLU over the whole context: a model with another hidden_act or a sliding
    window has no program (tests/models/test_parity.py checks its per-op logits against transformers)."""
    llm = LLM(tiny_model_factory(arch, **overrides), enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22)
    assert llm.engine.core.runner.model.dense_decoder() is None
    assert llm.engine.core.runner.fused_decode is None


def test_w8a8_keeps_the_per_op_path(tiny_model_factory):
    bound, _ = run(tiny_model_factory("llama"), "w8a8", True, PROMPTS[:1])
    assert not bound


@pytest.mark.parametrize("mode", [None, "int8", "int4", "fp8"])
def test_native_linear_runs_what_linear_forward_runs_at_every_row_count(tiny_model_factory, mode):
    llm = LLM(tiny_model_factory("qwen2"), quantization=mode, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 22)
    model = llm.engine.core.runner.model.model
    assert llm.engine.core.runner.fused_decode.max_rows > 10 ** 9            # int8/int4 tiles take any step; float32 has oneDNN above
    native = cpu_native.load()
    for linear in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj):
        as_built = linear.native_decode_linear(native)
        for rows in (1, 10, 11, 16, 17, 40, 200):
            x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(as_built(x), linear(x), rtol=1e-5, atol=1e-5)
        if mode is None:                              # oneDNN above a (here forced) limit of 16 rows
            assert linear.quant_method.large_kernel(linear)[0] == "onednn"
            large = native.LargeLinear(*linear.quant_method.large_kernel(linear))
            bias = None if linear.bias is None else linear.bias.data
            limited = native.DecodeLinear("f32", linear.f32_tiles, None, bias, linear.out_features, 16, large)
            for rows in (16, 17, 40):
                x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
                expected = linear.tile_fn(x) if rows <= 16 else linear.quant_method.apply(linear, x)
                torch.testing.assert_close(limited(x), expected, rtol=0, atol=0)
        elif mode == "fp8":      # fast mode: the fp16 or bfloat16 gemv, above 14 / 16 rows oneDNN's bfloat16 GEMM
            fast = hasattr(native, "fp8_linear_bf16")
            assert linear.quant_method.large_kernel(linear)[0] == ("fp8_bf16" if fast else "fp8")
            small_kind = ("fp8_f16" if hasattr(native, "fp8_gemv_f16") else
                          "fp8_bf16" if hasattr(native, "fp8_gemv_bf16") else "fp8")
            assert linear.quant_method.tile_weights(linear)[0] == small_kind
            assert linear.tile_max_rows == ({"fp8_f16": 14, "fp8_bf16": 16, "fp8": 16}[small_kind] if fast else 40)
            assert getattr(linear, "weight", None) is None
        else:                                         # int8/int4: the tiles are the only copy
            assert linear.quant_method.large_kernel(linear) is None
            assert getattr(linear, "qweight", None) is None and getattr(linear, "int4_packed", None) is None


@pytest.mark.parametrize("batch", [1, 20])
def test_a_group_scaled_fp8_checkpoint_runs_the_native_layers_as_the_per_op_path(tiny_model_factory, tmp_path, batch):
    """FP8 scales per 32 inputs (compressed-tensors "group"): the native DecodeLinear takes the layer's group
    size (not derivable from the scales' shape in general) and runs what Linear.forward runs at every row count;
    whole decode steps give the per-op path's tokens."""
    from tests.quant.test_fp8 import _write_checkpoint
    out = str(tmp_path / "fp8-group")
    _write_checkpoint(tiny_model_factory("llama", tie_word_embeddings=False), out, "compressed-tensors", "group")
    bound, native = run(out, None, True, PROMPTS[:batch])
    unbound, per_op = run(out, None, False, PROMPTS[:batch])
    assert bound and not unbound
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(native, per_op):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4
    llm = LLM(out, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22)
    down = llm.engine.core.runner.model.model.layers[0].mlp.down_proj
    assert down.fp8_kblock == 32 and down.fp8_scale.shape[-1] == down.in_features // 32
    as_built = down.native_decode_linear(cpu_native.load())
    for rows in (1, 10, 16, 17, 40):
        x = torch.randn(rows, down.in_features, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(as_built(x), down(x), rtol=1e-5, atol=1e-5)


def test_a_native_linear_without_a_large_kernel_says_so(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22)
    linear = llm.engine.core.runner.model.model.layers[0].self_attn.o_proj
    native = cpu_native.load()
    small_only = native.DecodeLinear("f32", linear.f32_tiles, None, None, linear.out_features, 16,
                                     native.LargeLinear("", linear.f32_tiles))
    assert small_only.max_rows() == 16
    small_only(torch.randn(16, linear.in_features))
    with pytest.raises(RuntimeError, match="17 rows but no kernel for more than 16"):
        small_only(torch.randn(17, linear.in_features))
    with pytest.raises(RuntimeError, match="unknown large kind"):
        native.DecodeLinear("f32", linear.f32_tiles, None, None, linear.out_features, 16,
                            native.LargeLinear("bf16", linear.f32_tiles))


SPEC_PROMPTS = [[101, 202, 303, 404, 505, 606, 707] * 4, [11, 12, 13] * 6 + [14], [7, 8, 9, 10, 11] * 3, [42] * 9]


def _speculate(model_dir: str, mode: str | None, native: bool, kv_cache_dtype: str, prompts):
    llm = LLM(model_dir, quantization=mode, native_decode_layers=native, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 23, block_size=4, kv_cache_dtype=kv_cache_dtype,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.engine.core.runner.fused_decode, llm.engine.stats().spec_decode


@pytest.mark.parametrize("mode,kv", [(None, "auto"), ("int4", "auto"), ("fp8", "auto"), ("int4", "fp8")])
@pytest.mark.parametrize("batch", [1, 4])
def test_verify_steps_run_natively_as_decode_rows_with_the_per_op_paths_tokens(tiny_model_factory, mode, kv, batch):
    """A verify step (1 + k new tokens of a request) runs in the program, each token a decode row seeing its
    causal prefix: greedy tokens equal the per-op path's (prefill kernel over the same rows) and no
    speculation's."""
    from tokenmill.quant import exact_mode
    model_dir = tiny_model_factory("llama")
    prompts = SPEC_PROMPTS[:batch]
    # fp8 exactly: its fast mode's kernels change with the step's rows (bfloat16 GEMV up to 10, oneDNN's
    # GEMM with a bfloat16 output above), so 20-row verify steps and 4-row decode steps may split near-ties
    # differently; speculation is lossless against the same numerics
    with exact_mode("fp8") if mode == "fp8" else contextlib.nullcontext():
        native, program, stats = _speculate(model_dir, mode, True, kv, prompts)
        per_op, unbound, _ = _speculate(model_dir, mode, False, kv, prompts)
        plain = LLM(model_dir, quantization=mode, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 23,
                    block_size=4, kv_cache_dtype=kv)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True))]
    assert unbound is None and stats.num_drafts > 0
    assert program.verify_steps > 0
    assert native == per_op == expected


def test_the_program_leaves_prefills_and_long_verify_steps_to_the_per_op_path(tiny_model_factory):
    from tokenmill.worker.input_batch import build_attention_metadata
    llm = LLM(tiny_model_factory("llama"), enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22, block_size=4)
    program = llm.engine.core.runner.fused_decode
    blocks = list(range(1, 40))
    meta = lambda *reqs: build_attention_metadata([(blocks, start, n) for start, n in reqs], 4)   # noqa: E731
    assert program.takes(meta((10, 1), (3, 1)))                    # decodes
    assert program.takes(meta((10, 5), (3, 1)))                    # a verify of 4 drafts beside a decode
    assert not program.takes(meta((0, 5)))                         # a request's first chunk: a prefill
    assert not program.takes(meta((10, program.max_query_len + 1)))
    assert program.takes(meta(*[(20, 5)] * 40))                    # 200 rows: int4/float32 take any number
    slots, lens = program.row_tables(meta((10, 3), (6, 1)))
    assert lens.tolist() == [11, 12, 13, 7]
    assert slots.shape == (4, 13) and slots[0, :11].tolist() == slots[2, :11].tolist()
    assert slots[3, :7].tolist() == [4 + i for i in range(7)]      # block 1's slots 4..7, then block 2's


def test_the_step_time_models_decode_rows_are_the_steps_the_program_takes(tiny_model_factory):
    """The engine's step-time model counts a step's multi-token chunks as decode rows exactly when the
    program runs the step (core/step_time.py DecodeRows, from the program's max_query_len and max_rows)."""
    from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
    from tokenmill.core.step_time import DecodeRows, step_features
    from tokenmill.worker.input_batch import build_attention_metadata
    llm = LLM(tiny_model_factory("llama"), enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22, block_size=4)
    program, rules = llm.engine.core.runner.fused_decode, llm.engine.core.decode_rows
    assert rules == DecodeRows(program.max_query_len, program.max_rows) == llm.engine.core.step_model.rows
    rng, blocks = random.Random(3), list(range(1, 40))
    for _ in range(300):
        reqs = [(rng.choice([0, rng.randrange(1, 60)]), rng.choice([1, 1, rng.randrange(2, 21)]))
                for _ in range(rng.randrange(1, 6))]
        if all(n == 1 for _, n in reqs):
            continue                                  # single tokens are decode rows on either path
        out = SchedulerOutput([ScheduledRequest("r", [1] * n, s, [0], True, SamplingParams(), [], [], ())
                               for s, n in reqs])
        as_rows = step_features(out, rules).prefill_tokens == 0
        assert as_rows == program.takes(build_attention_metadata([(blocks, s, n) for s, n in reqs], 4)), reqs


@pytest.mark.parametrize("native", [True, False])
def test_verify_steps_reach_the_step_time_model_as_the_platform_runs_them(tiny_model_factory, native):
    """With the program, a verify step is observed as 1 + k decode rows a request; without it, as prefill
    tokens beside nothing else."""
    from tokenmill.core.step_time import PER_OP
    llm = LLM(tiny_model_factory("llama"), native_decode_layers=native, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 23, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    core, seen = llm.engine.core, []
    observe = core.step_model.observe
    core.step_model.observe = lambda f, s: (seen.append(f), observe(f, s))
    llm.generate(SPEC_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert (core.decode_rows != PER_OP) == native
    assert llm.engine.stats().spec_decode.num_drafts > 0
    if native:                                        # 2 requests: more than 2 rows is a verify step
        verify = [f for f in seen if f.decode_rows > 2]
        assert core.runner.fused_decode.verify_steps > 0 and verify
        assert all(f.prefill_tokens == 0 for f in verify)
    else:                                             # prompts of 19 and 28: chunks of <= 10 are verifies
        verify = [f for f in seen if 0 < f.prefill_tokens <= 10]
        assert verify and all(f.decode_rows <= 2 for f in seen)
