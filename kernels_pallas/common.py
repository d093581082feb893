"""Backend detection, interpret-mode switch and per-backend block sizes for the Pallas kernels.

On CPU there is no Pallas compiler, so kernels run with ``interpret=True`` (the kernel body is
traced into an XLA scan over the grid): the same code that lowers to Triton on GPU and Mosaic on
TPU, checked for correctness, not speed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernel_target", default=None)
PLATFORMS = ("cpu", "gpu", "tpu")


@contextlib.contextmanager
def compile_target(platform: str) -> Iterator[None]:
    """Trace the kernels inside the block for ``platform`` ("gpu" | "tpu") although this host's
    backend differs: ahead-of-time compiles for abstract TPU devices on a CPU-only machine
    (``jax.experimental.topologies``; ``bench/aot.py``). Tiles, modes and ``interpret``
    defaults follow the target."""
    if platform not in PLATFORMS:
        raise ValueError(f"compile_target: platform must be one of {PLATFORMS}, got {platform!r}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def backend() -> str:
    """``"cpu" | "gpu" | "tpu"``: the :func:`compile_target` if one is active, else the default
    JAX backend (cuda and rocm count as gpu)."""
    if _TARGET.get() is not None:
        return _TARGET.get()
    name = jax.default_backend()
    if name in ("cuda", "rocm", "gpu"):
        return "gpu"
    if name not in ("cpu", "tpu"):
        raise ValueError(f"unsupported JAX backend {name!r}")
    return name


def use_interpret() -> bool:
    """True where Pallas kernels must run in interpret mode (CPU)."""
    return backend() == "cpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return use_interpret() if interpret is None else bool(interpret)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def vary_alike(*arrays: jax.Array) -> tuple[list[jax.Array], jax.sharding.ManualAxisType]:
    """Inside ``shard_map`` with ``check_vma``: ``arrays`` each made to vary over the union of
    the manual mesh axes any of them varies over, and that union as the ``manual_axis_type``
    of a ``pallas_call``'s output (which must say how it varies). Outside, no-ops and the
    empty type."""
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(varying - jax.typeof(a).mat.varying))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out, jax.sharding.ManualAxisType(varying=varying)


DIMS_NN = (((1,), (0,)), ((), ()))  # a [M, K] x b [K, N] -> [M, N]
DIMS_NT = (((1,), (1,)), ((), ()))  # a [M, D] x b [N, D] -> [M, N]


def dot_f32(a: jax.Array, b: jax.Array, dims=DIMS_NN) -> jax.Array:
    """The kernels' matmul: float32 accumulation, float32 inputs at full precision."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=jnp.float32)


def sublanes(dtype) -> int:
    """Rows of one packed TPU VMEM tile: 8 for 32-bit, 16 for bfloat16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile sizes of the MXFP4 matmul: rows of x, output columns, contracting elements.

    ``block_k`` is counted in weight elements (a multiple of 32, so a tile holds whole scale
    blocks); the kernel loads ``block_k / 2`` packed bytes and ``block_k / 32`` scale bytes."""
    block_m: int
    block_n: int
    block_k: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_k % 32:
            raise ValueError(f"block_k must be a multiple of 32, got {self.block_k}")


# Defaults and minimums. GPU (Pallas Triton): every loaded tile must have a power-of-two size and
# tl.dot needs M, N, K >= 16, so block_m >= 16 and block_k / 2 >= 16; decode (M <= 16) is weight
# bandwidth bound, so one 16-row tile, and N tiles of 64 give N/64 programs (112 for N = 7168) to
# fill the SMs (untuned: no GPU was available when this was written). TPU (Mosaic): lanes are N
# (multiples of 128), int8 scale rows come in sublane tiles of 32, so block_k = 1024 (32 scale
# rows per step). CPU: small tiles that exercise the multi-tile paths in interpret mode.
_DEFAULTS = {
    "gpu": BlockSizes(block_m=16, block_n=64, block_k=256),
    "tpu": BlockSizes(block_m=16, block_n=256, block_k=1024),
    "cpu": BlockSizes(block_m=16, block_n=128, block_k=256),
}
_MINIMUMS = {
    "gpu": BlockSizes(block_m=16, block_n=16, block_k=64),
    "tpu": BlockSizes(block_m=16, block_n=128, block_k=1024),
    "cpu": BlockSizes(block_m=8, block_n=8, block_k=32),
}


def default_block_sizes(which: str | None = None) -> BlockSizes:
    return _DEFAULTS[which or backend()]


def minimum_block_sizes(which: str | None = None) -> BlockSizes:
    return _MINIMUMS[which or backend()]


def needs_pow2(which: str | None = None) -> bool:
    """Triton requires power-of-two tile sizes."""
    return (which or backend()) in ("gpu", "cpu")
