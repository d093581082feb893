"""Device meshes from named axis sizes, validated against the devices at hand.

Axis names (the only place they are defined): ``data``, ``fsdp``, ``expert``, ``tensor``,
``sequence``. A layout's sizes may use ``-1`` once to take the remaining devices. For multi-slice
pods the sizes split into a within-slice part (fast interconnect, ``ici``) and an across-slice
part (data-center network, ``dcn``); ``jax.experimental.mesh_utils.create_hybrid_device_mesh``
orders the devices so each axis's ici part stays inside a slice.

Axis types: JAX 0.12 makes ``Explicit`` meshes by default, where every einsum whose operands
disagree on a contracting dimension's sharding is an error. We build meshes with ``Auto`` axes:
parameters and key activations are placed by the rules table (``rules.py``) and XLA's
partitioner inserts the collectives in between, as MaxText's default ``shard_mode`` does; MoE
expert parallelism uses ``shard_map`` with explicit specs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "tensor", "sequence")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes per axis: ``ici`` within a slice, ``dcn`` across slices (1 = none)."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...] = (1, 1, 1, 1, 1)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(i * d for i, d in zip(self.ici, self.dcn))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(AXES, self.sizes))


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"data=2,expert=4"`` or a mapping -> sizes for every axis (missing = 1)."""
    if spec is None or spec == "":
        return {a: 1 for a in AXES}
    items = spec.items() if isinstance(spec, Mapping) else (
        kv.split("=", 1) for kv in spec.split(",") if kv.strip())
    out = {a: 1 for a in AXES}
    for key, value in items:
        key = key.strip()
        if key not in AXES:
            raise ValueError(f"unknown mesh axis {key!r}; axes are {AXES}")
        try:
            out[key] = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"mesh axis {key}={value!r} is not an integer") from None
        if out[key] == 0 or out[key] < -1:
            raise ValueError(f"mesh axis {key}={out[key]}: sizes are positive or -1 (the rest)")
    return out


def resolve_sizes(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Fill a single ``-1`` with the remaining devices; check the product equals the devices."""
    vals = [int(sizes.get(a, 1)) for a in AXES]
    free = [i for i, v in enumerate(vals) if v == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {[AXES[i] for i in free]}")
    fixed = math.prod(v for v in vals if v != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh axes {_fmt(sizes)} (product {fixed}) do not divide the "
                             f"{num_devices} devices")
        vals[free[0]] = num_devices // fixed
    if math.prod(vals) != num_devices:
        raise ValueError(f"mesh axes {_fmt(dict(zip(AXES, vals)))} multiply to {math.prod(vals)}"
                         f" but there are {num_devices} devices")
    return tuple(vals)


def make_mesh(sizes: Mapping[str, int] | str | None = None, *,
              devices: Sequence[jax.Device] | None = None,
              dcn: Mapping[str, int] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with our five axes, ``Auto`` axis types.

    ``dcn`` gives the across-slice factor per axis for multi-slice pods (devices must carry
    ``slice_index``); the ``sizes`` are then the within-slice (ici) parts.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(sizes) if not isinstance(sizes, Mapping) else parse_mesh_spec(sizes)
    if dcn:
        dcn_sizes = tuple(int(dcn.get(a, 1)) for a in AXES)
        n_slices = math.prod(dcn_sizes)
        ici = resolve_sizes(sizes, len(devices) // n_slices)
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn_sizes, devices)
    else:
        ici = resolve_sizes(sizes, len(devices))
        try:
            arr = mesh_utils.create_device_mesh(ici, devices)
        except (AssertionError, ValueError, NotImplementedError):
            arr = np.asarray(devices).reshape(ici)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _fmt(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all 1"
