"""kdsa.kernels_pallas: Pallas kernels, each beside a plain-JAX reference with the same signature."""

from kdsa.kernels_pallas.mxfp4_matmul import (MXFP4Weights, mxfp4_grouped_matmul,
                                              mxfp4_grouped_matmul_prepared, mxfp4_matmul,
                                              mxfp4_matmul_prepared, prepare_mxfp4_weights)
from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention

__all__ = ["MXFP4Weights", "mxfp4_matmul", "mxfp4_grouped_matmul", "mxfp4_matmul_prepared",
           "mxfp4_grouped_matmul_prepared", "prepare_mxfp4_weights", "sparse_mla_attention"]
