"""Mixture-of-experts layers: router.py (which experts a token uses), experts.py (the MoE block, expert
parallelism), kernels.py (how the experts' GEMMs run: registry), triton_moe.py (the CUDA grouped GEMM)."""
from tokenmill.layers.moe.experts import Expert, FusedMoE, SparseMoeBlock, expert_token_counts, moe_blocks

__all__ = ["Expert", "FusedMoE", "SparseMoeBlock", "expert_token_counts", "moe_blocks"]
