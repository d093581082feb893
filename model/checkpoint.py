"""Model checkpoints on Orbax: streaming atomic save, abstract-init restore into (sharded) arrays.

Layout: one Orbax (``orbax.checkpoint.experimental.v1``) PyTree checkpoint whose tree is
``{"params": {"segments.0.layers.1.self_attn.q_proj.kernel": array, ...}}`` (every ``nnx``
variable of the model, flat keys joined with dots) and whose custom metadata holds
``{"kdsa": {"format": 1, "config": ModelConfig.to_hf_config(), "params": {key: [shape,
dtype]}, ...}}``. The config travels with the weights, so :func:`load_model` needs nothing else.

Writing refuses a destination that is a source, contains or lies inside one, or exists
without ``overwrite`` (then only a kdsa model folder or a Hugging Face folder is replaced):
``kdsa.model.folders.check_destination``.

Writing streams: arrays are handed over in batches of at most ``batch_bytes`` (Orbax "partial
save", each batch written and released before the next is produced, then one ``finalize``), so
a converter never holds the whole model. Writing is atomic: everything goes to a hidden temporary
directory beside ``path`` which is renamed to ``path`` only when complete; a previous checkpoint
at ``path`` is replaced only then, and an interrupted run leaves it untouched (plus a
``NAME.kdsa-tmp*`` directory, never at ``path``, removed by the next save).

Reading: :func:`load_model` builds the model abstractly (``nnx.eval_shape``), gives every
variable its target sharding (``shardings``: a function from the abstract state to its
shardings, e.g. ``kdsa.sharding.rules.layout_shardings(mesh, "generate")``; or one device), and
restores straight into those arrays. Besides a model folder it reads the model
out of a training checkpoint (``RUN_DIR/checkpoints/N``, or ``RUN_DIR/checkpoints`` / ``RUN_DIR``
for the newest step; ``kdsa.model.folders.locate``): the ``state`` checkpointable holds every
variable as ``params.KEY`` (trained) or ``rest.KEY``, the ``meta`` JSON item
(``meta/data.json``; ``meta/metadata`` in steps written with Orbax's v0 API) the model config.
A directory that is none of these, an Orbax checkpoint that kdsa did not write, one whose
parameters do not match its config, or one whose data is damaged raises ``CheckpointError`` (a
``ValueError``) naming the path and the problem in one line. Relative paths are made absolute
first.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.folders import (HF, CheckpointError, check_destination, folder_kind, locate,
                                one_line, orbax_context, orbax_reason, quiet_orbax,
                                replace_folder, tmp_sibling, tokenizer_files)  # noqa: F401
from kdsa.model.transformer import abstract_model  # noqa: F401 (re-exported)

FORMAT_VERSION = 1
DEFAULT_BATCH_BYTES = 1 << 30
# storage chunks of at most this many bytes (Orbax splits larger arrays, or shards); a larger
# stacked parameter is stored one layer row (an expert stack: one expert of one row) per chunk
# at most, so that a part of it is read without decoding the whole stack (:class:`StoredParam`)
CHUNK_BYTES = 1 << 28
ParamItem = tuple[str, Callable[[], jax.Array]]  # (flat key, producer)


def _ocp():
    from orbax.checkpoint.experimental import v1 as ocp

    return ocp


# ------------------------------------------------------------------------------- tree <-> keys

def flat_key(path: tuple) -> str:
    """``('segments', 0, 'layers', 1, 'self_attn', 'q_proj', 'kernel')`` -> dotted key."""
    return ".".join(str(p) for p in path)


def flat_variables(state: nnx.State) -> dict[str, nnx.Variable]:
    """``{dotted key: variable}`` of a model state, in tree order."""
    return {flat_key(p): v for p, v in nnx.to_flat_state(state)}


def target_shardings(state: nnx.State,
                     shardings: Callable[[nnx.State], nnx.State] | None = None
                     ) -> dict[str, Any]:
    """``{key: Sharding}``: ``shardings(state)`` (the same tree with a ``Sharding`` per
    variable), else the first local device for every variable."""
    if shardings is None:
        dev = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
        return {k: dev for k in flat_variables(state)}
    return flat_variables(shardings(state))


# ------------------------------------------------------------------------------- saving

def save_params(path: str | os.PathLike, config: ModelConfig, items: Iterable[ParamItem], *,
                metadata: dict | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                on_saved: Callable[[str, jax.Array], None] | None = None,
                compress: bool = False, overwrite: bool = False,
                sources: Iterable[str | os.PathLike] = (),
                extra_files: Mapping[str, str | os.PathLike] | None = None) -> Path:
    """Stream ``(key, producer)`` items into a new checkpoint at ``path`` (atomic).

    ``path`` is checked first by ``kdsa.model.destination.check_destination``: an existing
    ``path`` is replaced only with ``overwrite`` and only if it is a kdsa model folder or a
    Hugging Face checkpoint folder; ``sources`` (the paths the caller reads from) may not be,
    contain or hold ``path``.

    Producers are called in order; arrays are written in batches of at most ``batch_bytes``
    (a larger array alone) and dropped after each batch. ``on_saved(key, array)`` is called
    once an array's batch is written.
    The keys must be exactly the model's variables for ``config`` (checked at the end, before
    the rename). ``compress``: Orbax's zstd (off by default: trained weights barely compress and
    it costs CPU time on every write). ``extra_files`` (``{name: source path}``, e.g. the
    tokenizer: :func:`tokenizer_files`) are copied into the folder before it is renamed into
    place, so they arrive with it or not at all. Returns ``path``.
    """
    ocp = _ocp()
    path = check_destination(path, sources=sources, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    abstract = flat_variables(nnx.state(abstract_model(config)))
    want = {k: [list(v.shape), str(v.dtype)] for k, v in abstract.items()}
    custom = {"kdsa": {"format": FORMAT_VERSION, "config": config.to_hf_config(),
                       "params": want, **(metadata or {})}}
    tmp = tmp_sibling(path, "tmp")
    primary = jax.process_index() == 0
    if primary:  # leftovers of an interrupted run
        _remove_scratch(tmp)
    _sync("kdsa_checkpoint_start")
    done: set[str] = set()
    try:
        batch: dict[str, jax.Array] = {}
        size = 0

        ctx = orbax_context()
        ctx.array.saving.use_compression = compress
        ctx.array.saving.scoped_storage_options_creator = _storage_options

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
            for name, src in (extra_files or {}).items():
                shutil.copy2(src, tmp / name)
            replace_folder(tmp, path)
        _sync("kdsa_checkpoint_renamed")
    except BaseException:
        if primary:
            _remove_scratch(tmp)
        raise
    return path


def _remove_scratch(tmp: Path) -> None:
    """Remove ``tmp`` and Orbax's unfinished saves beside it (``tmp.partial_save*``,
    ``tmp.orbax-checkpoint-tmp*``), nothing else: a user's ``NAME.kdsa-tmp.bak`` stays."""
    for p in [tmp, *(q for suffix in (".partial_save", ".orbax-checkpoint-tmp")
                     for q in tmp.parent.glob(f"{tmp.name}{suffix}*"))]:
        shutil.rmtree(p, ignore_errors=True)


def _storage_options(keypath, value):
    """Storage chunks of at most :data:`CHUNK_BYTES`; a larger stack is first split along its
    leading axes: layer rows (``segments.*``), and experts too (``[R, E, N, K]`` stacks)."""
    ocp = _ocp()
    key, shape = str(getattr(keypath[-1], "key", keypath[-1])), tuple(value.shape)
    nbytes = math.prod(shape) * np.dtype(value.dtype).itemsize
    lead = 0
    if nbytes > CHUNK_BYTES and key.startswith("segments.") and len(shape) >= 2:
        lead = 2 if ".experts." in key and len(shape) == 4 else 1
    return ocp.options.ArrayOptions.Saving.StorageOptions(
        chunk_byte_size=CHUNK_BYTES, shard_axes=tuple(range(lead)))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_model(path: str | os.PathLike, config: ModelConfig, model: nnx.Module, *,
               metadata: dict | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
               overwrite: bool = False,
               extra_files: Mapping[str, str | os.PathLike] | None = None) -> Path:
    """Save every variable of ``model`` (built from ``config``) atomically to ``path``; an
    existing kdsa model folder there is replaced only with ``overwrite`` (``save_params``)."""
    variables = flat_variables(nnx.state(model))
    items = ((k, (lambda v=v: v[...])) for k, v in variables.items())
    return save_params(path, config, items, metadata=metadata, batch_bytes=batch_bytes,
                       overwrite=overwrite, extra_files=extra_files)


# ------------------------------------------------------------------------------- reading

def _orbax_metadata(path: Path, item: str | None = None):
    """``(Orbax CheckpointMetadata, why its array tree is missing or "")``: Orbax logs why it
    could not read the tree and returns None for it."""
    ocp = _ocp()
    with quiet_orbax() as logged:
        try:
            meta = ocp.metadata(path, **({} if item is None else {"checkpointable_name": item}))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds
            raise CheckpointError(f"{path}: an Orbax checkpoint whose metadata cannot be read "
                                  f"(damaged?): {orbax_reason(e)}") from None
    why = next((": " + one_line(m.split("Error details:", 1)[1]) for m in logged
                if "Error details:" in m), "")
    return meta, why


def _arrays(path: Path, meta, why: str) -> dict:
    """The array metadata tree (``{name: ArrayMetadata}``), or the error saying why not."""
    if not isinstance(meta.metadata, dict):
        raise CheckpointError(f"{path}: the array metadata cannot be read (damaged or "
                              f"truncated checkpoint?){why}")
    return meta.metadata


def read_info(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """``(config, kdsa metadata)`` of a checkpoint written by kdsa (a model folder, or a
    training checkpoint: :func:`locate`); clear errors otherwise. For a training checkpoint the
    metadata is ``{"format", "config", "params", "training": {"step", "path"}}``."""
    path, training = locate(path)
    if training:
        config, info, _ = _train_info(path)
        return config, dict(info)
    if folder_kind(path) == HF:
        raise CheckpointError(f"{path}: a Hugging Face checkpoint folder, not a kdsa one; "
                              f"convert it first: kdsa convert hf-to-orbax {path} DST")
    if not any((path / f).exists() for f in ("_CHECKPOINT_METADATA", "orbax.checkpoint")):
        raise CheckpointError(f"{path}: not an Orbax checkpoint (no _CHECKPOINT_METADATA); "
                              f"expected a kdsa model folder, a training checkpoint "
                              f"RUN_DIR/checkpoints/N, RUN_DIR/checkpoints or RUN_DIR")
    meta, why = _orbax_metadata(path)
    ours = (meta.custom_metadata or {}).get("kdsa")
    if not isinstance(ours, dict) or "config" not in ours or "params" not in ours:
        raise CheckpointError(f"{path}: an Orbax checkpoint, but not one written by kdsa (no "
                              f"'kdsa' model metadata, and not a training checkpoint); write it "
                              f"with kdsa.model.checkpoint.save_model or `kdsa convert "
                              f"hf-to-orbax`")
    if ours.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: kdsa checkpoint format {ours.get('format')!r}, this "
                              f"version reads format {FORMAT_VERSION}")
    config = _config(path, ours["config"])
    stored = set(_arrays(path, meta, why).get("params", {}))
    if stored != set(ours["params"]):
        raise CheckpointError(f"{path}: the stored arrays do not match the parameter list "
                              f"(missing {sorted(set(ours['params']) - stored)[:5]})")
    return config, ours


def _config(path: Path, hf: dict) -> ModelConfig:
    try:
        return ModelConfig.from_hf_config(hf)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: the stored model config is invalid: {e}") from None


def _train_info(step: Path) -> tuple[ModelConfig, dict, dict[str, str]]:
    """``(config, metadata, {model key: state key})`` of a training checkpoint folder; the
    model's variables are the state's ``params.KEY`` (trained) and ``rest.KEY`` (the rest)."""
    return _train_info_cached(str(step), (step / "_CHECKPOINT_METADATA").stat().st_mtime_ns)


# the training checkpoint's ``meta`` item (JSON): Orbax v1's JsonHandler writes data.json; steps
# written before kdsa's training checkpoints moved to the v1 API (v0 JsonSave) hold "metadata"
META_FILES = ("data.json", "metadata")


def _meta_file(step: Path) -> Path:
    return next((f for f in (step / "meta" / n for n in META_FILES) if f.is_file()),
                step / "meta" / META_FILES[0])


@functools.lru_cache(maxsize=4)
def _train_info_cached(step_dir: str, stamp: int) -> tuple[ModelConfig, dict, dict[str, str]]:
    step = Path(step_dir)
    what = f"{step}: a kdsa training checkpoint"
    try:
        meta = json.loads(_meta_file(step).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} whose meta item cannot be read (damaged?): "
                              f"{one_line(str(e))}") from None
    hf = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{what} without a model config in its meta item (an RL "
                              f"reference policy holds parameters only)")
    config = _config(step, hf)
    stored = _arrays(step, *_orbax_metadata(step, "state"))
    names, missing = {}, []
    for k in flat_variables(nnx.state(abstract_model(config))):
        name = next((f"{part}.{k}" for part in ("params", "rest") if f"{part}.{k}" in stored),
                    None)
        if name is None:
            missing.append(k)
        names[k] = name
    if missing:
        raise CheckpointError(f"{what}, but its state lacks {len(missing)} variable(s) of the "
                              f"model config it names, e.g. {missing[:3]}")
    params = {k: [list(stored[n].shape), str(stored[n].dtype)] for k, n in names.items()}
    info = {"format": FORMAT_VERSION, "config": hf, "params": params,
            "training": {"step": meta.get("step"), "path": str(step),
                         "init_from": meta.get("init_from")}}
    return config, info, names


def load_params(path: str | os.PathLike, targets: dict[str, jax.ShapeDtypeStruct]
                ) -> dict[str, jax.Array]:
    """Restore the named parameters (a subset is fine) into ``targets``' shapes, dtypes and
    shardings, from a model folder or a training checkpoint (:func:`locate`). Damaged data
    raises :class:`CheckpointError`."""
    ocp = _ocp()
    path, training = locate(path)
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    names = _train_info(path)[2] if training else None
    try:
        with ctx, quiet_orbax():
            if names is None:
                return ocp.load(path, {"params": targets})["params"]
            out = ocp.load(path, {names[k]: t for k, t in targets.items()},
                           checkpointable_name="state")
    except Exception as e:  # noqa: BLE001 - tensorstore / orbax errors of many kinds
        raise CheckpointError(f"{path}: cannot restore {len(targets)} parameter(s) (damaged or "
                              f"incompatible data?): {orbax_reason(e)}") from None
    return {k: out[names[k]] for k in targets}


class StoredParam:
    """One stored parameter opened for reads of parts of it (a block of layers or experts),
    without restoring the whole array: an export of ``k3-2.8t`` reads expert stacks of 434 GB
    (bf16; ``[22, 896, 3584, 3072]``) one block of storage chunks at a time. ``shape``,
    ``chunk`` (the storage chunk shape: a block aligned to it is read without decoding more),
    ``read(index)`` (a tuple of slices) -> host array. Damaged data raises
    :class:`CheckpointError`."""

    def __init__(self, path: str | os.PathLike, key: str):
        import tensorstore as ts

        path, training = locate(path)
        name = _train_info(path)[2][key] if training else f"params.{key}"
        self.where = f"{path}: parameter {key}"
        kvstore = {"driver": "ocdbt", "base": (path / "state").as_uri(), "path": f"{name}/"}
        for driver in ("zarr3", "zarr"):  # Orbax v1's arrays; v0's (training steps before v1)
            try:  # an array per tree path in the checkpointable's OCDBT store
                self.store = ts.open({"driver": driver, "open": True, "kvstore": kvstore},
                                     read=True).result()
                break
            except Exception as e:  # noqa: BLE001 - tensorstore errors of many kinds
                error = e
        else:
            raise CheckpointError(f"{self.where} cannot be opened (damaged or incompatible "
                                  f"data?): {one_line(str(error))}") from None
        self.shape = tuple(self.store.shape)
        self.chunk = tuple(self.store.chunk_layout.read_chunk.shape or self.shape)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        try:
            return np.asarray(self.store[index].read().result())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.where} cannot be read (damaged data?): "
                                  f"{one_line(str(e))}") from None


def iter_params(path: str | os.PathLike, config: ModelConfig, keys: Iterable[str] | None = None,
                ) -> Iterator[tuple[str, np.ndarray]]:
    """``(key, host array)`` one whole parameter at a time (one resident)."""
    abstract = flat_variables(nnx.state(abstract_model(config)))
    dev = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
    for k in keys if keys is not None else abstract:
        v = abstract[k]
        arr = load_params(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev)})[k]
        yield k, np.asarray(arr)


def load_model(path: str | os.PathLike,
               shardings: Callable[[nnx.State], nnx.State] | None = None
               ) -> tuple[ModelConfig, nnx.Module]:
    """Restore a kdsa checkpoint (a model folder, or the model inside a training checkpoint:
    :func:`locate`): ``(config, model)`` with every variable placed by ``shardings`` (see
    :func:`target_shardings`; ``kdsa.sharding.rules.layout_shardings(mesh, layout)`` places by a
    layout's rules) or on one device when it is None. Each process reads only its shards."""
    path = locate(path)[0]
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
    where = target_shardings(state, shardings)
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=where[k])
               for k, v in variables.items()}
    arrays = load_params(path, targets)
    flat = [(p, v.replace(arrays[flat_key(p)])) for p, v in nnx.to_flat_state(state)]
    return config, nnx.merge(graphdef, nnx.from_flat_state(flat))
