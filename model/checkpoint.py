"""Model checkpoints on Orbax: streaming atomic save, abstract-init restore into (sharded) arrays.

Layout: one Orbax (``orbax.checkpoint.experimental.v1``) PyTree checkpoint whose tree is
``{"params": {"segments.0.layers.1.self_attn.q_proj.kernel": array, ...}}`` (every ``nnx``
variable of the model, flat keys joined with dots) and whose custom metadata holds
``{"kdsa": {"format": 1, "config": ModelConfig.to_hf_config(), "params": {key: [shape,
dtype]}, ...}}``. The config travels with the weights, so :func:`load_model` needs nothing else.

Writing streams: arrays are handed over in batches of at most ``batch_bytes`` (Orbax "partial
save", each batch written and released before the next is produced, then one ``finalize``), so
a converter never holds the whole model. Writing is atomic: everything goes to a hidden temporary
directory beside ``path`` which is renamed to ``path`` only when complete; a previous checkpoint
at ``path`` is replaced only then, and an interrupted run leaves it untouched (plus a
``NAME.kdsa-tmp*`` directory, never at ``path``, removed by the next save).

Reading: :func:`load_model` builds the model abstractly (``nnx.eval_shape``), gives every
variable its target sharding (``kdsa.sharding.rules.state_shardings`` on ``mesh``, or one
device), and restores straight into those arrays. A directory that is not an Orbax checkpoint,
an Orbax checkpoint that kdsa did not write, one whose parameters do not match its config, or one
whose data is damaged raises ``ValueError`` naming the path and the problem.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from kdsa.model.config import ModelConfig

FORMAT_VERSION = 1
DEFAULT_BATCH_BYTES = 1 << 30
ParamItem = tuple[str, Callable[[], jax.Array]]  # (flat key, producer)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written as asked."""


def _ocp():
    from orbax.checkpoint.experimental import v1 as ocp

    return ocp


# ------------------------------------------------------------------------------- tree <-> keys

def flat_key(path: tuple) -> str:
    """``('segments', 0, 'layers', 1, 'self_attn', 'q_proj', 'kernel')`` -> dotted key."""
    return ".".join(str(p) for p in path)


def abstract_model(config: ModelConfig):
    """The model built abstractly: every variable holds a ``ShapeDtypeStruct``."""
    from kdsa.model.transformer import Transformer

    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def flat_variables(state: nnx.State) -> dict[str, nnx.Variable]:
    """``{dotted key: variable}`` of a model state, in tree order."""
    return {flat_key(p): v for p, v in nnx.to_flat_state(state)}


def target_shardings(state: nnx.State, mesh=None, layout: str = "train") -> dict[str, Any]:
    """``{key: Sharding}``: by the layout's rules on ``mesh``, else the first local device."""
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return {k: dev for k in flat_variables(state)}
    from kdsa.sharding.rules import state_shardings

    return flat_variables(state_shardings(state, mesh, layout))


# ------------------------------------------------------------------------------- saving

def _tmp_sibling(path: Path, tag: str) -> Path:
    """``NAME.kdsa-TAG``: deterministic, so every process of a multi-host job agrees on it;
    not hidden, as Orbax's partial-save finalize mishandles names starting with "."."""
    return path.parent / f"{path.name}.kdsa-{tag}"


def save_params(path: str | os.PathLike, config: ModelConfig, items: Iterable[ParamItem], *,
                metadata: dict | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                on_saved: Callable[[str, jax.Array], None] | None = None,
                compress: bool = False) -> Path:
    """Stream ``(key, producer)`` items into a new checkpoint at ``path`` (atomic).

    Producers are called in order; arrays are written in batches of at most ``batch_bytes``
    (a larger array alone) and dropped after each batch. ``on_saved(key, array)`` is called
    once an array's batch is written.
    The keys must be exactly the model's variables for ``config`` (checked at the end, before
    the rename). ``compress``: Orbax's zstd (off by default: trained weights barely compress and
    it costs CPU time on every write). Returns ``path``.
    """
    ocp = _ocp()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    abstract = flat_variables(nnx.state(abstract_model(config)))
    want = {k: [list(v.shape), str(v.dtype)] for k, v in abstract.items()}
    custom = {"kdsa": {"format": FORMAT_VERSION, "config": config.to_hf_config(),
                       "params": want, **(metadata or {})}}
    tmp = _tmp_sibling(path, "tmp")
    primary = jax.process_index() == 0
    if primary:  # leftovers of an interrupted run
        for p in tmp.parent.glob(f"{tmp.name}*"):
            shutil.rmtree(p, ignore_errors=True)
    _sync("kdsa_checkpoint_start")
    done: set[str] = set()
    try:
        batch: dict[str, jax.Array] = {}
        size = 0

        ctx = ocp.Context()
        ctx.array.saving.use_compression = compress

        def flush():
            nonlocal batch, size
            if batch:
                with ctx:
                    ocp.partial.save(tmp, {"params": batch}, custom_metadata=custom)
                for k, a in batch.items():
                    if on_saved is not None:
                        on_saved(k, a)
                batch, size = {}, 0

        for key, produce in items:
            if key not in want:
                raise CheckpointError(f"parameter {key} is not in the model for this config")
            if key in done:
                raise CheckpointError(f"parameter {key} given twice")
            nbytes = int(np.prod(abstract[key].shape)) * np.dtype(abstract[key].dtype).itemsize
            if batch and size + nbytes > batch_bytes:
                flush()  # before producing: a batch never exceeds batch_bytes (or one array)
            a = produce()
            got = [list(a.shape), str(a.dtype)]
            if got != want[key]:
                raise CheckpointError(f"parameter {key}: got {got[1]}{got[0]}, the config wants "
                                      f"{want[key][1]}{want[key][0]}")
            done.add(key)
            batch[key] = a
            size += a.size * a.dtype.itemsize
            del a  # the batch holds it; nothing else may keep it alive past its flush
            if size >= batch_bytes:
                flush()
        flush()
        missing = [k for k in want if k not in done]
        if missing:
            raise CheckpointError(f"{len(missing)} parameter(s) never given, e.g. {missing[:5]}")
        with ctx:
            ocp.partial.finalize(tmp)
        if primary:
            _replace(tmp, path)
        _sync("kdsa_checkpoint_renamed")
    except BaseException:
        if primary:
            for p in tmp.parent.glob(f"{tmp.name}*"):
                shutil.rmtree(p, ignore_errors=True)
        raise
    return path


def _replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first, removed after."""
    old = None
    if path.exists():
        old = _tmp_sibling(path, "old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_model(path: str | os.PathLike, config: ModelConfig, model: nnx.Module, *,
               metadata: dict | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES) -> Path:
    """Save every variable of ``model`` (built from ``config``) atomically to ``path``."""
    variables = flat_variables(nnx.state(model))
    items = ((k, (lambda v=v: v[...])) for k, v in variables.items())
    return save_params(path, config, items, metadata=metadata, batch_bytes=batch_bytes)


# ------------------------------------------------------------------------------- reading

def read_info(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """``(config, kdsa metadata)`` of a checkpoint written by kdsa; clear errors otherwise."""
    ocp = _ocp()
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not any((path / f).exists() for f in ("_CHECKPOINT_METADATA", "orbax.checkpoint")):
        raise CheckpointError(f"{path}: not an Orbax checkpoint (no _CHECKPOINT_METADATA)")
    try:
        meta = ocp.metadata(path)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds
        raise CheckpointError(f"{path}: an Orbax checkpoint whose metadata cannot be read "
                              f"(damaged?): {type(e).__name__}: {str(e)[:300]}") from None
    ours = (meta.custom_metadata or {}).get("kdsa")
    if not isinstance(ours, dict) or "config" not in ours or "params" not in ours:
        raise CheckpointError(f"{path}: an Orbax checkpoint, but not one written by kdsa (no "
                              f"'kdsa' model metadata); write it with kdsa.model.checkpoint."
                              f"save_model or `kdsa convert hf-to-orbax`")
    if ours.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: kdsa checkpoint format {ours.get('format')!r}, this "
                              f"version reads format {FORMAT_VERSION}")
    try:
        config = ModelConfig.from_hf_config(ours["config"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: the stored model config is invalid: {e}") from None
    stored = set(meta.metadata.get("params", {}) if isinstance(meta.metadata, dict) else ())
    if stored != set(ours["params"]):
        raise CheckpointError(f"{path}: the stored arrays do not match the parameter list "
                              f"(missing {sorted(set(ours['params']) - stored)[:5]})")
    return config, ours


def load_params(path: str | os.PathLike, targets: dict[str, jax.ShapeDtypeStruct]
                ) -> dict[str, jax.Array]:
    """Restore the named parameters (a subset is fine) into ``targets``' shapes, dtypes and
    shardings. Damaged data raises :class:`CheckpointError`."""
    ocp = _ocp()
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    try:
        with ctx:
            out = ocp.load(Path(path), {"params": targets})
    except Exception as e:  # noqa: BLE001 - tensorstore / orbax errors of many kinds
        raise CheckpointError(f"{path}: cannot restore {len(targets)} parameter(s) (damaged or "
                              f"incompatible data?): {type(e).__name__}: {str(e)[:300]}") from None
    return out["params"]


def iter_params(path: str | os.PathLike, config: ModelConfig, keys: Iterable[str] | None = None,
                ) -> Iterator[tuple[str, np.ndarray]]:
    """``(key, host array)`` one parameter at a time (bounded memory; for export)."""
    abstract = flat_variables(nnx.state(abstract_model(config)))
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    for k in keys if keys is not None else abstract:
        v = abstract[k]
        arr = load_params(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev)})[k]
        yield k, np.asarray(arr)


def load_model(path: str | os.PathLike, mesh=None, *, layout: str = "train"
               ) -> tuple[ModelConfig, nnx.Module]:
    """Restore a kdsa checkpoint: ``(config, model)`` with every variable placed by
    ``layout``'s sharding rules on ``mesh`` (or on one device when ``mesh`` is None)."""
    config, ours = read_info(path)
    abstract = abstract_model(config)
    graphdef, state = nnx.split(abstract)
    variables = flat_variables(state)
    stored = {k: tuple(s) for k, (s, _) in ours["params"].items()}
    bad = [f"{k}: stored {list(stored.get(k, ()))}, config wants {list(v.shape)}"
           for k, v in variables.items() if stored.get(k) != tuple(v.shape)]
    if bad:
        raise CheckpointError(f"{path}: parameters do not match the stored config: "
                              + "; ".join(bad[:5]))
    shardings = target_shardings(state, mesh, layout)
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
               for k, v in variables.items()}
    arrays = load_params(path, targets)
    flat = [(p, v.replace(arrays[flat_key(p)])) for p, v in nnx.to_flat_state(state)]
    return config, nnx.merge(graphdef, nnx.from_flat_state(flat))
