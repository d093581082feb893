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
import logging
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


# Named layouts per preset (``-1`` = the remaining devices); ``--mesh`` replaces one entirely.
# tiny/small: any device count. Kimi Linear: experts within an 8-GPU node. K3 train: 896
# experts over 64 devices (14 each), FSDP takes the rest (1024 H200: 16). K3 generate: 32-way
# EP x 8-way TP (28 experts per device, 42.5 GiB bf16 weights), replicas take the rest; the
# numbers behind these choices are in docs/sharding.md (``kdsa plan``).
DEFAULT_LAYOUTS: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {"train": {"fsdp": -1}, "generate": {"data": -1}},
    "small": {"train": {"fsdp": -1}, "generate": {"data": -1}},
    "kimi-linear-48b": {"train": {"expert": 8, "fsdp": -1},
                        "generate": {"expert": 8, "data": -1}},
    "k3-2.8t": {"train": {"expert": 64, "fsdp": -1},
                "generate": {"expert": 32, "tensor": 8, "data": -1}},
}
LAYOUTS = ("train", "generate")


def layout_sizes(preset: str | None, layout: str,
                 override: str | Mapping[str, int] | None = None) -> dict[str, int]:
    """Axis sizes of a named layout: ``override`` if given, else the preset's default
    (``{"fsdp": -1}`` / ``{"data": -1}`` for presets without one)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    if override:
        return parse_mesh_spec(override)
    fallback = {"train": {"fsdp": -1}, "generate": {"data": -1}}
    return parse_mesh_spec(DEFAULT_LAYOUTS.get(preset or "", fallback)[layout])


def read_layouts(raw, where: str) -> dict[str, dict[str, int]]:
    """A layouts section ``{"train": {"expert": 2, "fsdp": -1}, "generate": "data=2,tensor=2"}``
    (any subset of :data:`LAYOUTS`; sizes as a mapping or an ``AXIS=N,...`` string) ->
    ``{layout: sizes}``, validated: unknown layouts or axes, non-integer sizes and more than one
    ``-1`` are errors naming ``where`` and the key."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: the layouts must be a JSON object {{\"train\": {{...}}, "
                         f"\"generate\": {{...}}}}, got {type(raw).__name__}")
    out = {}
    for layout, spec in raw.items():
        if layout not in LAYOUTS:
            raise ValueError(f"{where}: unknown layout {layout!r}; layouts are {LAYOUTS}")
        if isinstance(spec, Mapping):
            bad = [f"{k}={v!r}" for k, v in spec.items()
                   if not isinstance(v, int) or isinstance(v, bool)]
            if bad:
                raise ValueError(f"{where}: {layout}.{bad[0]} is not an integer")
        elif not isinstance(spec, str):
            raise ValueError(f"{where}: {layout} must be an object of axis sizes or an "
                             f"'AXIS=N,...' string, got {spec!r}")
        try:
            sizes = parse_mesh_spec(spec)
        except ValueError as e:
            raise ValueError(f"{where}: {layout}: {e}") from None
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"{where}: {layout}: only one mesh axis may be -1, got "
                             f"{[a for a, v in sizes.items() if v == -1]}")
        out[layout] = sizes
    return out


def device_array(sizes: Mapping[str, int] | str | None, devices: Sequence,
                 dcn: Mapping[str, int] | str | None = None) -> np.ndarray:
    """Devices arranged ``[data, fsdp, expert, tensor, sequence]``.

    Without ``dcn``: ``sizes`` (one ``-1`` allowed) must multiply to the device count. With
    ``dcn`` (multi-slice pods; devices carry ``slice_index``): ``sizes`` are the per-slice
    (ici) parts, ``dcn`` the across-slice factors; axis ``a`` has ``ici[a] * dcn[a]`` devices
    and moving along its dcn part changes slice (``create_hybrid_device_mesh``).
    """
    devices = list(devices)
    sizes = parse_mesh_spec(sizes)
    if dcn:
        dcn_sizes = tuple(parse_mesh_spec(dcn).values())
        if -1 in dcn_sizes:
            raise ValueError(f"dcn sizes must be explicit (no -1), got {dcn}")
        n_slices = math.prod(dcn_sizes)
        slices = {getattr(d, "slice_index", 0) for d in devices}
        if len(slices) != n_slices:
            raise ValueError(f"dcn axes {_fmt(dict(zip(AXES, dcn_sizes)))} ask for {n_slices} "
                             f"slices but the devices span {len(slices)}")
        if len(devices) % n_slices:
            raise ValueError(f"{len(devices)} devices do not split into {n_slices} equal slices")
        ici = resolve_sizes(sizes, len(devices) // n_slices)
        return mesh_utils.create_hybrid_device_mesh(ici, dcn_sizes, devices)
    ici = resolve_sizes(sizes, len(devices))
    # TPU: devices by their place in the torus; a shape that does not map onto whole physical
    # axes may split one (K3's generate expert=32,tensor=8 on v5p:8x8x16: each tensor group an
    # 8-chip ring, each expert group 2 x 16 chips); a plain reshape of the device list, the last
    # resort (CPU and GPU lists are in order), scattered groups over the torus
    for split in (False, True):
        try:
            return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=split)
        except (AssertionError, ValueError, NotImplementedError):
            continue
    if devices and devices[0].platform == "tpu":
        logging.getLogger("kdsa.mesh").warning(
            "mesh %s: no arrangement follows the TPU torus; devices taken in list order "
            "(slower collectives)", _fmt(dict(zip(AXES, ici))))
    return np.asarray(devices).reshape(ici)


def make_mesh(sizes: Mapping[str, int] | str | None = None, *,
              devices: Sequence[jax.Device] | None = None,
              dcn: Mapping[str, int] | str | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all, every process's) with our five axes, ``Auto``
    axis types; see :func:`device_array` for ``sizes`` and ``dcn``."""
    arr = device_array(sizes, devices if devices is not None else jax.devices(), dcn)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def fit_layout(config, layout: str, *, preset: str | None = None,
               override: str | Mapping[str, int] | None = None, batch: int | None = None,
               seq: int | None = None, devices: Sequence | None = None, log=None,
               per_process_multiple: int = 1) -> Mesh:
    """The mesh of a run. ``override`` (``--mesh``): exactly those sizes over ``devices``
    (default all), checked against the model and batch (:func:`check_layout`, clear error).
    Otherwise the preset's default layout (:func:`layout_sizes`) with its ``-1`` axis as large
    as the devices allow *and* the model and batch fit (e.g. ``fsdp=-1`` with 8 devices and a
    micro-batch of 2 rows gives ``fsdp=2`` on 2 devices; ``log`` says so). With several
    processes a device subset takes the same number of devices from each, a multiple of
    ``per_process_multiple`` (RL: each process's generate mesh, which the weights are gathered
    onto from the process's own share)."""
    devices = list(devices if devices is not None else jax.devices())
    if override:
        sizes = dict(zip(AXES, resolve_sizes(parse_mesh_spec(override), len(devices))))
        check_layout(config, sizes, layout, batch=batch, seq=seq)
        return make_mesh(sizes, devices=devices)
    want = layout_sizes(preset, layout)
    free = [a for a in AXES if want[a] == -1]
    fixed = math.prod(v for v in want.values() if v != -1)
    if not free or len(devices) % fixed:
        sizes = dict(zip(AXES, resolve_sizes(want, len(devices))))
        check_layout(config, sizes, layout, batch=batch, seq=seq)
        return make_mesh(sizes, devices=devices)
    top = len(devices) // fixed
    error, fallback, uneven = None, None, None
    procs = len({d.process_index for d in devices})  # a subset takes as many from each
    for f in [f for f in range(top, 0, -1) if top % f == 0 and (fixed * f) % procs == 0]:
        sizes = dict(want, **{free[0]: f})
        try:
            check_layout(config, sizes, layout, batch=batch, seq=seq)
        except ValueError as e:
            error = error or e
            continue
        if procs > 1 and (fixed * f // procs) % per_process_multiple:
            uneven = uneven or sizes
            continue
        replicated = replicated_weight_dims(config, sizes, layout)
        if replicated:  # fits, but whole weights on every device: a smaller size, if any, first
            fallback = fallback or (f, sizes, replicated)
            continue
        return _fitted(sizes, devices, fixed * f, f < top, layout, top, free[0], log)
    if fallback is None and uneven is not None:
        raise ValueError(f"{layout} layout: {_fmt(uneven)} fits the model and batch but gives "
                         f"each of {procs} processes {math.prod(uneven.values()) // procs} "
                         f"devices, not a multiple of {per_process_multiple}; pass --mesh, or "
                         f"a batch that splits over more devices")
    if fallback is None:
        raise error or ValueError(f"{layout} layout: no size of {free[0]} splits evenly over "
                                  f"{procs} processes; pass --mesh")
    f, sizes, replicated = fallback
    if log is not None:
        log(f"{layout} layout: {_fmt(sizes)} keeps {'; '.join(replicated)}; these weights are "
            f"whole on every device (no smaller size avoids it; pass --mesh to choose)")
    return _fitted(sizes, devices, fixed * f, f < top, layout, top, free[0], log)


def _fitted(sizes, devices, n, fewer, layout, top, axis, log) -> Mesh:
    use = _spread(devices, n)
    if fewer and log is not None:
        log(f"{layout} layout: {_fmt(sizes)} on {len(use)} of {len(devices)} devices "
            f"(the model, its weights or the batch do not split {top}-way over {axis}; pass "
            f"--mesh to choose)")
    return make_mesh(sizes, devices=use)


def replicated_weight_dims(config, sizes: Mapping[str, int], layout: str) -> list[str]:
    """The weight dims sharded by ``layout`` that take none of their mesh axes under ``sizes``:
    the first axis of their rule does not divide them, so the rules' prefix fallback keeps the
    whole weight on every device (K3's hidden 7168 over ``fsdp=24``: its 57.5B non-expert
    parameters and their optimizer state whole on each of 1,536 devices)."""
    from kdsa.sharding.rules import get_rules

    rules = get_rules(layout)
    dims = [("embed", "hidden_size", config.hidden_size),
            ("q_lora", "q_lora_rank", getattr(config, "q_lora_rank", None)),
            ("kv_lora", "kv_lora_rank", getattr(config, "kv_lora_rank", None))]
    out = []
    for logical, what, dim in dims:
        axes = [a for a in (rules.get(logical) or ()) if sizes.get(a, 1) > 1]
        if dim and axes and dim % sizes[axes[0]]:
            out.append(f"{what}={dim} unsplit by {axes[0]}={sizes[axes[0]]}")
    return out


def _spread(devices: list, n: int) -> list:
    """``n`` of ``devices``: the first ones, or the same count from every process."""
    if n == len(devices):
        return devices
    procs = sorted({d.process_index for d in devices})
    if len(procs) == 1:
        return devices[:n]
    if n % len(procs):
        raise ValueError(f"{n} devices do not split evenly over {len(procs)} processes; pass "
                         f"--mesh with sizes that use every device")
    per = n // len(procs)
    return [d for p in procs for d in [d for d in devices if d.process_index == p][:per]]


def check_layout(config, sizes: Mapping[str, int], layout: str, *, batch: int | None = None,
                 seq: int | None = None) -> None:
    """Raise ``ValueError`` listing every model (and batch) dimension that ``layout`` shards
    over mesh axes whose product does not divide it. ``sizes`` are resolved (no ``-1``).

    Checked: experts (expert parallelism needs whole experts per device), attention, KDA and
    indexer heads over the activation head axes, the routed-expert hidden size (split inside
    the expert-parallel ``shard_map``), and, when given, the batch and sequence length over the
    activation axes. Weight dims need not divide: the rules fall back to a prefix.
    """
    from kdsa.sharding.rules import get_rules

    rules = get_rules(layout)
    dims = [("experts", "num_experts", config.num_experts),
            ("act_heads", "num_attention_heads", config.num_attention_heads),
            ("act_heads", "linear_attn_config.num_heads", config.linear_attn_config.num_heads),
            ("act_heads", "index_n_heads", config.index_n_heads),
            ("expert_mlp", "moe_intermediate_size", config.moe_intermediate_size),
            ("act_batch", "the batch size", batch), ("act_seq", "the sequence length", seq)]
    problems = []
    for logical, what, dim in dims:
        axes = tuple(a for a in (rules.get(logical) or ()) if sizes.get(a, 1) > 1)
        prod = math.prod(sizes[a] for a in axes)
        if dim and axes and dim % prod:
            problems.append(f"{what}={dim} is not divisible by mesh axes "
                            f"{'x'.join(f'{a}={sizes[a]}' for a in axes)} (product {prod}, "
                            f"logical axis {logical!r})")
    if problems:
        raise ValueError(f"layout {layout!r} with mesh {_fmt(sizes)} does not fit the model: "
                         + "; ".join(problems))


def _fmt(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all 1"
