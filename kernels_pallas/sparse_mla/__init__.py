"""Sparse top-k MLA attention (DeepSeek Sparse Attention, absorbed form): reference, Pallas, ops."""

from kdsa.kernels_pallas.sparse_mla.ops import sparse_mla_attention
from kdsa.kernels_pallas.sparse_mla.ref import dense_masked_mla_attention, sparse_mla_attention_ref

__all__ = ["sparse_mla_attention", "sparse_mla_attention_ref", "dense_masked_mla_attention"]
