"""layers/moe against transformers' routers and a per-token loop: softmax top-k (Mixtral, Qwen3-MoE),
DeepSeek-V3's grouped sigmoid routing with the correction bias; the grouped experts (each expert once)
and the Triton grouped GEMM (under Triton's interpreter without a GPU) equal the loop; expert ownership
under expert parallelism."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: kernels run on the CPU

from tokenmill.config import MoEConfig  # noqa: E402
from tokenmill.distributed.parallel_state import split_evenly  # noqa: E402
from tokenmill.layers.moe.experts import FusedMoE, _owner_rank  # noqa: E402
from tokenmill.layers.moe.router import Router  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_router(kind: str, **cfg):
    import transformers
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
        return MixtralTopKRouter(transformers.MixtralConfig(hidden_size=32, **cfg))
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        return Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=32, **cfg))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    return DeepseekV3TopkRouter(transformers.DeepseekV3Config(hidden_size=32, **cfg))


@pytest.mark.parametrize("kind,hf_cfg,moe", [
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2), MoEConfig(8, 2, 16, (0,))),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
     MoEConfig(8, 3, 16, (0,), renormalize=False)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True),
     MoEConfig(16, 4, 16, (0,), scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
               correction_bias=True)),
])
def test_router_matches_transformers(kind, hf_cfg, moe):
    hf = _hf_router(kind, **hf_cfg)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(moe.num_experts, 32, generator=g)
    ours = Router(32, moe)
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
        if moe.correction_bias:            # a bias large enough to change choices
            bias = torch.randn(moe.num_experts, generator=g) * 0.5
            hf.e_score_correction_bias.copy_(bias)
            ours.e_score_correction_bias.copy_(bias)
    x = torch.randn(50, 32, generator=g)
    w, ids = ours(x)
    _, hw, hids = hf(x)
    order, horder = ids.sort(dim=1), hids.sort(dim=1)
    assert torch.equal(order.values, horder.values)                  # the same experts per token
    torch.testing.assert_close(w.gather(1, order.indices), hw.float().gather(1, horder.indices), rtol=1e-6, atol=1e-6)


def _moe(num_experts=6, hidden=64, intermediate=32, seed=0) -> FusedMoE:
    moe = FusedMoE(hidden, MoEConfig(num_experts, 2, intermediate, (0,)), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for e in moe.local_experts():
        e.gate_up_proj.weight.data.copy_(torch.randn(2 * intermediate, hidden, generator=g) * 0.1)
        e.down_proj.weight.data.copy_(torch.randn(hidden, intermediate, generator=g) * 0.1)
    return moe


def _loop(moe: FusedMoE, x, weights, ids) -> torch.Tensor:
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * moe.local_experts()[int(ids[t, j])](x[t:t + 1])[0]
    return out


def _routing(tokens, num_experts, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=g), ids


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_experts_read_each_expert_once_and_equal_the_loop(tokens):
    moe = _moe()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(tokens, 6, 2)
    calls = []
    for i, e in enumerate(moe.local_experts()):
        e.register_forward_hook(lambda m, inp, out, i=i: calls.append((i, inp[0].shape[0])))
    got = moe(x, weights, ids)
    assert sorted(i for i, _ in calls) == sorted(set(ids.flatten().tolist()))     # each used expert once
    assert sum(n for _, n in calls) == ids.numel()
    torch.testing.assert_close(got, _loop(moe, x, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_triton_grouped_gemm_equals_the_grouped_linears(tokens):
    pytest.importorskip("triton")
    ref = _moe()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(tokens, 6, 2, seed=4)
    want = ref(x, weights, ids)
    moe = _moe().to(DEVICE)
    moe.set_kernel("triton")
    assert moe.w13.shape == (6, 64, 64) and moe.local_experts()[0].gate_up_proj.weight is None
    got = moe(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_triton_layout_pads_each_expert_to_whole_blocks():
    from tokenmill.layers.moe.triton_moe import BLOCK_M, sort_rows_by_expert
    experts = torch.tensor([2, 0, 2, 2, 1, 0])
    layout = sort_rows_by_expert(experts, 4)
    rows = layout.sorted_rows.view(-1, BLOCK_M)
    for b, e in enumerate(layout.block_expert.tolist()):
        real = [r for r in rows[b].tolist() if r < 6]
        if e == 4:
            assert real == []                               # past the last expert's blocks: no work
        else:
            assert real and all(int(experts[r]) == e for r in real)
    assert sorted(r for r in layout.sorted_rows.tolist() if r < 6) == list(range(6))


def test_triton_kernel_refuses_quantized_experts():
    from tokenmill.layers.quantize import quantize_model
    moe = _moe()
    quantize_model(moe, "int8")
    with pytest.raises(ValueError, match="float expert weights"):
        moe.set_kernel("triton")


@pytest.mark.parametrize("num_experts,ranks", [(8, 2), (7, 2), (10, 3), (3, 3)])
def test_owner_rank_is_split_evenly(num_experts, ranks):
    owners = _owner_rank(torch.arange(num_experts), num_experts, ranks).tolist()
    want = []
    for r in range(ranks):
        want += [r] * split_evenly(num_experts, ranks, r)[1]
    assert owners == want


def test_unknown_moe_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown MoE kernel 'cutlass'"):
        _moe().set_kernel("cutlass")


@pytest.mark.parametrize("method", [None, "int8"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_cpu_grouped_gemm_equals_the_experts_weights(method, tokens):
    """The native grouped kernel (AVX2) on the experts' own weights, float32 or as the int8 method
    quantized them, gives what float Linears of those (dequantized) weights give."""
    from tokenmill.layers.quantize import quantize_model
    from tokenmill.platforms import cpu_moe
    moe = _moe()
    quantize_model(moe, method or "float")
    if not cpu_moe.supports(moe):
        pytest.skip("no native AVX2 build here")
    moe.set_kernel("cpu_grouped")
    assert moe.w13.shape == (6, 64, 64) and moe.w2.shape == (6, 64, 32)
    ref = _moe()                                   # float Linears holding exactly the weights the kernel reads
    for e, expert in enumerate(ref.local_experts()):
        for layer, w, scale in ((expert.gate_up_proj, moe.w13, moe.w13_scale), (expert.down_proj, moe.w2, moe.w2_scale)):
            layer.weight.data.copy_(w[e].float() * (1 if scale is None else scale[e].unsqueeze(1)))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(tokens, 6, 2, seed=6)
    torch.testing.assert_close(moe(x, weights, ids), ref(x, weights, ids), rtol=1e-5, atol=1e-5)
