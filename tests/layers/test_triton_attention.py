"""The Triton paged attention kernels against the reference backend, on small shapes: block boundaries,
partial blocks, grouped-query heads, several sequences, scattered block tables, context splits; gpt-oss's sinks
and sliding windows against layers/attention/sinks.py's torch path. On a
machine without a GPU they run under Triton's interpreter (TRITON_INTERPRET=1); with one, on the GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")

from tokenmill.layers.attention import AttentionMetadata, SeqSpan, get_backend  # noqa: E402
from tokenmill.layers.attention.triton_kernels import (paged_decode_attention,  # noqa: E402
                                                       paged_prefill_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(num_kv_heads, head_dim, block_size, num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, num_blocks * block_size, head_dim)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g), g


def _tables(context_lens, block_size, num_blocks, g):
    """A block table per sequence, blocks drawn without repetition in scattered order; padded with -1."""
    need = [-(-n // block_size) for n in context_lens]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(need)), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    return tables


def _reference(q, k_cache, v_cache, tables, starts, query_lens, context_lens, block_size, scale):
    seqs = []
    for i, (start, qlen, clen) in enumerate(zip(starts, query_lens, context_lens)):
        pos = torch.arange(clen)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        seqs.append(SeqSpan(start, qlen, clen, slots))
    new_slots = torch.cat([s.context_slots[s.context_len - s.query_len:] for s in seqs])
    meta = AttentionMetadata(slot_mapping=new_slots, seqs=seqs)
    k_new, v_new = k_cache[:, new_slots].transpose(0, 1), v_cache[:, new_slots].transpose(0, 1)   # no-op write
    out = get_backend("reference").forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta, scale)
    return out.view(q.shape)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 3)])
@pytest.mark.parametrize("context_lens,num_splits", [([1], None), ([8, 9, 16, 17], None), ([40, 3, 64], 3),
                                                     ([100], 7)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_kernel_matches_the_reference(kv_heads, group, context_lens, num_splits, block_size):
    head_dim, num_blocks = 64, 40
    k_cache, v_cache, g = _cache(kv_heads, head_dim, block_size, num_blocks, seed=sum(context_lens) + group)
    tables = _tables(context_lens, block_size, num_blocks, g)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=g)
    scale = head_dim ** -0.5
    ref = _reference(q, k_cache, v_cache, tables, list(range(len(context_lens))), [1] * len(context_lens),
                     context_lens, block_size, scale)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                 lens.to(DEVICE), block_size, scale, num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4)])
@pytest.mark.parametrize("chunks", [[(0, 5)], [(0, 16), (0, 17)], [(7, 9), (0, 33), (30, 2)], [(16, 20)]])
def test_prefill_kernel_matches_the_reference(kv_heads, group, chunks):
    """chunks: (start position, new tokens) per sequence; a start > 0 is a continuation chunk whose prefix
    is already cached."""
    head_dim, block_size, num_blocks = 64, 8, 30
    k_cache, v_cache, g = _cache(kv_heads, head_dim, block_size, num_blocks, seed=len(chunks) * 10 + group)
    query_lens = [n for _, n in chunks]
    context_lens = [s + n for s, n in chunks]
    starts = [sum(query_lens[:i]) for i in range(len(chunks))]
    tables = _tables(context_lens, block_size, num_blocks, g)
    # a view into a wider tensor, as q is a slice of the fused qkv projection
    q = torch.randn(sum(query_lens), kv_heads * group + 2, head_dim, generator=g)[:, :kv_heads * group]
    scale = head_dim ** -0.5
    ref = _reference(q, k_cache, v_cache, tables, starts, query_lens, context_lens, block_size, scale)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = paged_prefill_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                  as_tensor(starts), as_tensor(query_lens), as_tensor(context_lens), block_size,
                                  scale, max(query_lens))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_a_clear_error():
    q = torch.randn(1, 3, 64)
    k = torch.randn(2, 16, 64)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q, k, k, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                               8, 0.1)
    with pytest.raises(ValueError, match="power-of-two"):
        paged_decode_attention(torch.randn(1, 2, 64), k, k, torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 6, 0.1)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("gpt_oss", {}),
                                              ("mistral", {"tie_word_embeddings": False, "sliding_window": 4})])
def test_the_engine_on_the_triton_backend_gives_the_reference_tokens(tiny_model_factory, arch, overrides):
    """End to end on a tiny model: decodes, prefill chunks split by a small token budget (continuations
    over a cached prefix), prefix-cache hits on the second pass; same tokens and logprobs as the reference
    (gpt-oss: its sinks and a window of 4 on layer 0 in the kernels, against sinks.py's torch ops; Mistral:
    a window of 4 on every layer, no sinks)."""
    from tokenmill import LLM, SamplingParams
    tiny_model_dir = tiny_model_factory(arch, **overrides)
    prompts = ["a short one", "a somewhat longer prompt that the small token budget prefills in chunks " * 2,
               [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    options = dict(kv_cache_memory_bytes=4 << 20, block_size=8, max_num_batched_tokens=24)
    results = {}
    for backend in ("reference", "triton"):
        llm = LLM(tiny_model_dir, attention_backend=backend, **options)
        results[backend] = [llm.generate(prompts, params) for _ in range(2)]      # the second pass hits the cache
        assert llm.engine.stats().prefix_cache_hits_total > 0
    for ref_pass, tri_pass in zip(results["reference"], results["triton"]):
        for ref, tri in zip(ref_pass, tri_pass):
            assert tri.outputs[0].token_ids == ref.outputs[0].token_ids
            for a, b in zip(tri.outputs[0].logprobs, ref.outputs[0].logprobs):
                assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-4


def _fp8(k_cache, v_cache):
    """(float8 caches, their KVScales, the float caches they decode to) from float caches."""
    from tokenmill.layers.attention.fp8_kv import KVScales, dequantize, write_fp8_cache
    k8, v8 = torch.zeros_like(k_cache, dtype=torch.float8_e4m3fn), torch.zeros_like(v_cache, dtype=torch.float8_e4m3fn)
    scales = KVScales(k_cache.shape[0])
    slots = torch.arange(k_cache.shape[1])
    write_fp8_cache(k_cache.transpose(0, 1) * 5, v_cache.transpose(0, 1) / 5, k8, v8, slots, scales)
    return k8, v8, scales, dequantize(k8, scales.k), dequantize(v8, scales.v)


def _check_against_reference_values(k_stored, v_stored, k_ref, v_ref, g, **kwargs):
    """The kernels over caches as stored (fp8 codes, bfloat16, ...) equal the reference backend over the float
    values they stand for (k_ref, v_ref): decode with context splits, then two prefill chunks."""
    kv_heads, head_dim, block_size, group = k_stored.shape[0], k_stored.shape[2], 8, 2
    num_blocks = k_stored.shape[1] // block_size
    scale = head_dim ** -0.5
    context_lens = [40, 3, 64]
    tables = _tables(context_lens, block_size, num_blocks, g)
    q = torch.randn(3, kv_heads * group, head_dim, generator=g)
    ref = _reference(q, k_ref, v_ref, tables, [0, 1, 2], [1, 1, 1], context_lens, block_size, scale)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q.to(DEVICE), k_stored.to(DEVICE), v_stored.to(DEVICE), tables.to(DEVICE),
                                 lens.to(DEVICE), block_size, scale, num_splits=3, **kwargs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    chunks = [(7, 9), (0, 33)]
    query_lens, ctx = [n for _, n in chunks], [s + n for s, n in chunks]
    starts = [0, query_lens[0]]
    tables = _tables(ctx, block_size, num_blocks, g)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g)
    ref = _reference(q, k_ref, v_ref, tables, starts, query_lens, ctx, block_size, scale)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = paged_prefill_attention(q.to(DEVICE), k_stored.to(DEVICE), v_stored.to(DEVICE), tables.to(DEVICE),
                                  as_tensor(starts), as_tensor(query_lens), as_tensor(ctx), block_size, scale,
                                  max(query_lens), **kwargs)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_kernels_read_an_fp8_cache_as_the_reference_reads_its_values():
    """kv_cache_dtype="fp8": the kernels decode the cache's bytes in place (times each kv head's scale) to
    exactly the values the reference backend dequantizes: decode (with context splits) and prefill chunks."""
    k_cache, v_cache, g = _cache(2, 64, 8, 30, seed=5)
    k8, v8, scales, k_ref, v_ref = _fp8(k_cache, v_cache)
    _check_against_reference_values(k8, v8, k_ref, v_ref, g, kv_scales=scales.to(DEVICE))


def test_kernels_read_a_bf16_cache_under_float32_queries_as_its_values_widened():
    """kv_cache_dtype="bfloat16" under a float32 model: the kernels load the cache's bfloat16 values and compute
    in float32, as the reference does over the same values widened: decode (context splits) and prefill."""
    k_cache, v_cache, g = _cache(2, 64, 8, 30, seed=6)
    k16, v16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    _check_against_reference_values(k16, v16, k16.float(), v16.float(), g)


def _sink_reference(q, k_cache, v_cache, tables, starts, query_lens, context_lens, block_size, scale, sinks, window):
    """layers/attention/sinks.py's torch path over the same cache (every sequence as a chunk)."""
    from tokenmill.layers.attention.sinks import sink_attention
    seqs = []
    for i, (start, qlen, clen) in enumerate(zip(starts, query_lens, context_lens)):
        pos = torch.arange(clen)
        seqs.append(SeqSpan(start, qlen, clen, tables[i, pos // block_size].long() * block_size + pos % block_size))
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), seqs=seqs)
    return sink_attention(q, k_cache, v_cache, meta, scale, sinks, window).view(q.shape)


@pytest.mark.parametrize("window", [None, 1, 5, 17])
def test_decode_kernel_takes_sinks_and_windows(window):
    """gpt-oss: splits wholly before a window read nothing; the sinks join the merged softmax."""
    kv_heads, group, head_dim, block_size, num_blocks = 2, 2, 64, 8, 40
    context_lens = [1, 40, 3, 64]
    k_cache, v_cache, g = _cache(kv_heads, head_dim, block_size, num_blocks, seed=5)
    tables = _tables(context_lens, block_size, num_blocks, g)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=g)
    sinks = torch.randn(kv_heads * group, generator=g) * 3
    ref = _sink_reference(q, k_cache, v_cache, tables, list(range(4)), [1] * 4, context_lens, block_size, 0.125,
                          sinks, window)
    out = paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                 torch.tensor(context_lens, dtype=torch.int32).to(DEVICE), block_size, 0.125,
                                 num_splits=3, sinks=sinks.to(DEVICE), window=window)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 1, 5, 17])
def test_prefill_kernel_takes_sinks_and_windows(window):
    kv_heads, group, head_dim, block_size, num_blocks = 1, 4, 64, 8, 30
    chunks = [(7, 9), (0, 33), (30, 2)]
    k_cache, v_cache, g = _cache(kv_heads, head_dim, block_size, num_blocks, seed=9)
    query_lens, context_lens = [n for _, n in chunks], [s + n for s, n in chunks]
    starts = [sum(query_lens[:i]) for i in range(len(chunks))]
    tables = _tables(context_lens, block_size, num_blocks, g)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g)
    sinks = torch.randn(kv_heads * group, generator=g) * 3
    ref = _sink_reference(q, k_cache, v_cache, tables, starts, query_lens, context_lens, block_size, 0.125, sinks,
                          window)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = paged_prefill_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                                  as_tensor(starts), as_tensor(query_lens), as_tensor(context_lens), block_size,
                                  0.125, max(query_lens), sinks=sinks.to(DEVICE), window=window)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_prefill_kernel_multiplies_float32_in_ieee_and_half_types_on_tensor_cores(monkeypatch):
    """tl.dot's default input precision is tf32 (10-bit mantissas on NVIDIA tensor cores, errors near 1e-3 at
    these shapes), which the interpreter does not show: the launcher must ask for "ieee" with float32 q."""
    from tokenmill.layers.attention import triton_kernels
    assert triton_kernels.dot_precision(torch.float32) == "ieee"
    assert triton_kernels.dot_precision(torch.bfloat16) == "tf32" and triton_kernels.dot_precision(torch.float16) == "tf32"
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(triton_kernels, "_prefill_kernel", Recorder())
    k_cache = torch.zeros(1, 16, 64)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        paged_prefill_attention(torch.zeros(4, 2, 64, dtype=dtype), k_cache.to(dtype), k_cache.to(dtype),
                                torch.zeros(1, 2, dtype=torch.int32), as_tensor([0]), as_tensor([4]), as_tensor([4]),
                                8, 0.125, 4)
    assert [kw["PRECISION"] for kw in launched] == ["ieee", "tf32"]


def test_a_mixed_step_builds_its_kernel_operands_once_for_every_layer(monkeypatch):
    """Decodes and chunks in one step: the block-table rows, lengths and chunk spans are built by the first
    layer from the step's metadata and reused by the next layers (on a GPU each torch.tensor(list, device)
    or CPU-indexed gather per layer was a host sync); outputs as the reference's, layer after layer."""
    from tokenmill.layers.attention import triton_backend
    from tokenmill.worker.input_batch import build_attention_metadata
    kv_heads, group, head_dim, block_size, num_blocks = 2, 2, 64, 8, 30
    k_cache, v_cache, g = _cache(kv_heads, head_dim, block_size, num_blocks, seed=11)
    order = torch.randperm(num_blocks, generator=g).tolist()
    # (start position, new tokens): a decode, a continuation chunk, a decode, a first chunk
    shapes = [(20, 1), (9, 7), (3, 1), (0, 12)]
    requests = []
    for start, n in shapes:
        need = -(-(start + n) // block_size)
        requests.append((order[:need], start, n))
        order = order[need:]
    meta = build_attention_metadata(requests, block_size)
    num_tokens = sum(n for _, n in shapes)
    builds = []
    real = triton_backend.mixed_step_operands
    monkeypatch.setattr(triton_backend, "mixed_step_operands", lambda m, d: builds.append(m) or real(m, d))
    backend, reference = get_backend("triton"), get_backend("reference")
    for layer in range(3):
        q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=g)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
        ref = reference.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
        k_layer, v_layer = k_cache.clone(), v_cache.clone()
        with monkeypatch.context() as m:
            if layer:             # a later layer makes no host tensor of its own
                m.setattr(torch, "tensor", lambda *a, **kw: pytest.fail("a torch.tensor in a later layer"))
            got = backend.forward(q, k, v, k_layer, v_layer, meta, 0.125)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert builds == [meta]
    ops = backend.step_operands(meta, torch.device("cpu"))
    assert ops.decode_rows.tolist() == [0, 8] and ops.decode_lens.tolist() == [21, 4]
    assert ops.prefill_starts.tolist() == [1, 9] and ops.prefill_lens.tolist() == [7, 12]
    assert ops.prefill_contexts.tolist() == [16, 12] and ops.max_query_len == 12
    next_step = build_attention_metadata(requests, block_size)
    backend.step_operands(next_step, torch.device("cpu"))
    assert builds == [meta, next_step]
