"""Lightning-indexer scores read through a paged pool's block table: reference, Pallas, ops."""

from kdsa.kernels_pallas.paged_index.ops import paged_index_scores
from kdsa.kernels_pallas.paged_index.ref import paged_index_scores_ref

__all__ = ["paged_index_scores", "paged_index_scores_ref"]
