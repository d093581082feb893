"""MXFP4 weight x bf16/f32 activation matmuls (dense and grouped MoE): reference, Pallas, ops."""

from kdsa.kernels_pallas.mxfp4_matmul.kernel import MXFP4Weights, prepare_mxfp4_weights
from kdsa.kernels_pallas.mxfp4_matmul.ops import (dequantize_prepared, mxfp4_grouped_matmul,
                                                  mxfp4_grouped_matmul_prepared, mxfp4_matmul,
                                                  mxfp4_matmul_prepared)
from kdsa.kernels_pallas.mxfp4_matmul.ref import mxfp4_grouped_matmul_ref, mxfp4_matmul_ref

__all__ = ["MXFP4Weights", "prepare_mxfp4_weights", "dequantize_prepared", "mxfp4_matmul",
           "mxfp4_grouped_matmul", "mxfp4_matmul_prepared", "mxfp4_grouped_matmul_prepared",
           "mxfp4_matmul_ref", "mxfp4_grouped_matmul_ref"]
