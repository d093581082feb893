"""Post-training from published weights: start a run from a kdsa model folder, end it with one.

``kdsa train --init-from DIR`` and ``kdsa rl --init-from DIR`` take DIR's model config (what
``kdsa convert hf-to-orbax`` wrote, a previous run's ``RUN_DIR/model``, or a training
checkpoint) and its parameters:

* :func:`training_config` -- the config that is trained: DIR's, with float routed experts
  (MXFP4 experts are frozen bytes, so they are dequantized, exactly, into ``param_dtype``; with
  ``expert_qat`` the forward fake-quantizes those float master weights again, so the first
  forward is the MXFP4 model's). Only the fields that steer training, not the architecture,
  may be overridden (:data:`TRAINING_FIELDS`).
* :func:`initial_state` -- the step-0 ``TrainState``: the parameters restored straight into the
  ``train`` layout's shardings (abstract model, then each process reads only its own shards,
  ``model.checkpoint.load_params``), MXFP4 experts unpacked and the optimizer state initialised
  by one program compiled with the state's shardings as outputs, so no host ever holds the
  whole tree. The optimizer starts fresh.
* :func:`fresh_indexer` -- a K3 checkpoint converted with a new DSA indexer (listed under
  ``fresh`` in its metadata) starts in the indexer's dense warm-up stage
  (``docs/conversion.md``).
* :func:`export_model` -- every run that finishes writes ``RUN_DIR/model``: the config, the
  weights (routed experts in MXFP4 when the run started from MXFP4 weights or was asked to,
  ``--export-experts``) and the tokenizer files of DIR, a folder that ``kdsa generate``,
  ``kdsa serve`` and ``kdsa convert orbax-to-hf`` read.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.model.folders import DestinationError, write_overlap
from kdsa.model.moe_mxfp4 import pack_expert_arrays, unpack_expert_arrays
from kdsa.sharding.rules import layout_shardings
from kdsa.train.config import TrainConfig
from kdsa.train.step import init_state

# what a converted folder's metadata says of its Hugging Face source (layout, names, dtypes,
# config.json), which exports of the runs that start from it carry along
SOURCE_FACTS = ("source", "hf_dtypes", "hf_tails")

# ModelConfig fields that change how a model is trained or run, not what it computes
TRAINING_FIELDS = frozenset({"remat_policy", "expert_qat", "compute_dtype", "index_dtype",
                             "attention_impl", "moe_impl", "scan_layers", "kda_chunk_size",
                             "dsa_query_chunk_size"})


def check_overrides(path: str | os.PathLike, keys: list[str]) -> None:
    """``--set`` keys given with ``--init-from``: training-only fields, else a ValueError."""
    bad = sorted({k.partition("=")[0].partition(".")[0] for k in keys} - TRAINING_FIELDS)
    if bad:
        raise ValueError(f"--set {', '.join(bad)}: with --init-from the architecture comes "
                         f"from {path}; only {', '.join(sorted(TRAINING_FIELDS))} may be set")


def training_config(stored: ModelConfig) -> ModelConfig:
    """The stored config as it is trained: float routed experts (see the module docstring)."""
    if stored.expert_weight_format != "mxfp4":
        return stored
    return stored.replace(expert_weight_format="bf16", moe_impl="xla")


def fresh_indexer(path: str | os.PathLike) -> bool:
    """Whether DIR's DSA indexer was initialised fresh by the conversion (metadata ``fresh``)."""
    _, info = ckpt.read_info(path)
    return any("indexer" in str(k) for k in info.get("fresh") or ())


def indexer_stage_for(path: str | os.PathLike, tc: TrainConfig, *, chosen: bool
                      ) -> TrainConfig:
    """``tc`` in the dense warm-up stage when DIR's indexer is fresh and no stage was
    ``chosen`` (``--train-set indexer_stage=...``); else ``tc`` as it is."""
    if chosen or not fresh_indexer(path):
        return tc
    return tc.replace(indexer_stage="dense_warmup")


def initial_state(path: str | os.PathLike, config: ModelConfig, tc: TrainConfig, tx, *,
                  shardings=None, mesh=None):
    """The step-0 ``TrainState`` of ``config`` (:func:`training_config` of DIR's) with DIR's
    parameters, in ``shardings`` on ``mesh`` (the train layout), or on the first local device
    when both are None."""
    stored, _ = ckpt.read_info(path)
    if training_config(stored).replace(**{f: getattr(config, f) for f in TRAINING_FIELDS}) \
            != config:
        raise ValueError(f"--init-from {path}: its model config differs from the one trained")
    abstract = nnx.state(ckpt.abstract_model(stored))
    variables = ckpt.flat_variables(abstract)
    where = ckpt.target_shardings(abstract, layout_shardings(mesh, "train"))
    arrays = ckpt.load_params(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                             sharding=where[k])
                                     for k, v in variables.items()})
    unpack = stored.expert_weight_format == "mxfp4"

    def build(arrays):
        if unpack:
            arrays = unpack_expert_arrays(arrays, jnp.dtype(config.param_dtype))
        graphdef, state = nnx.split(ckpt.abstract_model(config))
        flat = [(p, v.replace(arrays[ckpt.flat_key(p)])) for p, v in nnx.to_flat_state(state)]
        return init_state(nnx.merge(graphdef, nnx.from_flat_state(flat)), tc, tx)[1]

    if shardings is None:
        return jax.device_put(jax.jit(build)(arrays), jax.local_devices()[0])
    return jax.jit(build, out_shardings=shardings)(arrays)


def init_from_path(init_from: str | os.PathLike | None) -> str | None:
    """``init_from`` as the absolute path a training checkpoint's metadata records, so that
    ``kdsa convert orbax-to-hf RUN_DIR/checkpoints/N`` finds the source's layout, tensor names
    and tokenizer there; None without one."""
    return None if init_from is None else str(Path(init_from).absolute())


def resumed_origin(recorded: str | None, given: str | None, log) -> str | None:
    """The start folder of a resumed run: the one its checkpoint recorded (the weights descend
    from the first start), or, when that folder is gone and ``--init-from`` names another one,
    the given one (moved: the run's final export reads its layout and tokenizer there; the
    recorded path used to win and the export failed on every resume)."""
    if recorded and given and recorded != given and not Path(recorded).exists():
        log(f"the run's start folder {recorded} is gone; --init-from {given} stands in for it")
        return given
    return recorded or given


def same_architecture(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether ``a`` and ``b`` compute the same model (training fields and the routed experts'
    storage format aside)."""
    ta, tb = training_config(a), training_config(b)
    return ta.replace(**{f: getattr(tb, f) for f in TRAINING_FIELDS}) == tb


def source_folder(path: str | os.PathLike, config: ModelConfig | None = None
                  ) -> tuple[Path | None, dict, str]:
    """``(folder, metadata, "")`` of the converted model folder ``path``'s weights descend
    from: ``path`` itself when its metadata names a Hugging Face source (a converted folder, a
    ``RUN_DIR/model``), else the folder its run started from (``init_from`` in a training
    checkpoint's metadata), followed back through earlier runs. ``(None, {}, why)`` when the
    chain ends without a source (``why`` empty: random initial weights) or at a folder that
    cannot be read now or holds another model than ``config``."""
    seen: set[str] = set()
    while True:
        try:
            where = ckpt.locate(path)[0]
            if str(where.resolve()) in seen:
                return None, {}, f"{path} leads back to {where} (a loop)"
            seen.add(str(where.resolve()))
            stored, info = ckpt.read_info(where)
        except (ckpt.CheckpointError, OSError) as e:
            return None, {}, f"{path} cannot be read now ({e})"
        if config is not None and not same_architecture(stored, config):
            return None, {}, f"{path} now holds another model"
        if "source" in info:
            return where, info, ""
        path = (info.get("training") or {}).get("init_from")
        if not path:
            return None, {}, ""


def tokenizer_folder(init_from: str | os.PathLike | None) -> Path | None:
    """The folder holding ``init_from``'s tokenizer (``tiktoken.model`` or
    ``tokenizer.json``): ``init_from``'s, else that of the converted folder it descends from
    (:func:`source_folder`: a training checkpoint of a post-training run); None without
    ``init_from`` or any tokenizer (the byte tokenizer)."""
    if init_from is None:
        return None
    has_model = lambda f: bool({"tiktoken.model", "tokenizer.json"}  # noqa: E731
                               & set(ckpt.tokenizer_files(f)))
    folder = ckpt.locate(init_from)[0]
    if has_model(folder):
        return folder
    folder = source_folder(init_from)[0]  # (walked only when the start folder has none)
    return folder if folder is not None and has_model(folder) else None


def export_format(init_from: str | os.PathLike | None, asked: str | None) -> str:
    """The routed-expert format of ``RUN_DIR/model``: ``asked``, else MXFP4 when the run
    started from MXFP4 weights, else float."""
    if asked is not None:
        if asked not in ("bf16", "mxfp4"):
            raise ValueError(f"--export-experts must be bf16 or mxfp4, got {asked!r}")
        return asked
    if init_from is not None and ckpt.read_info(init_from)[0].expert_weight_format == "mxfp4":
        return "mxfp4"
    return "bf16"


def export_model(run_dir: str | os.PathLike, config: ModelConfig, graphdef, state, *,
                 experts: str = "bf16", tokenizer_from: str | os.PathLike | None = None,
                 metadata: dict | None = None) -> Path:
    """Write ``RUN_DIR/model`` (atomic; a previous export of this run is replaced): the
    trained parameters and routing biases of ``state``, experts packed to MXFP4 when
    ``experts == "mxfp4"``, the tokenizer files of ``tokenizer_from`` and its source metadata
    (Hugging Face layout and dtypes, so ``orbax-to-hf`` writes the source's tensor names).
    Every process of a job calls it (each writes its shards)."""
    model = nnx.merge(graphdef, state.params, state.rest)
    flat = {k: v[...] for k, v in ckpt.flat_variables(nnx.state(model)).items()}
    out = config
    if experts == "mxfp4" and config.num_experts:
        flat = jax.jit(pack_expert_arrays)(flat)
        out = config.replace(expert_weight_format="mxfp4")
    tok, meta = {}, dict(metadata or {})
    if tokenizer_from is not None:  # what the export keeps of the folder it started from
        tok = ckpt.tokenizer_files(tokenizer_folder(tokenizer_from)
                                   or ckpt.locate(tokenizer_from)[0])
        _, info, _ = source_folder(tokenizer_from, config)
        # the source checkpoint's layout and dtypes: orbax-to-hf writes its names back
        meta.update({k: info[k] for k in SOURCE_FACTS if k in info})
    return ckpt.save_params(Path(run_dir) / "model", out,
                            ((k, (lambda a=a: a)) for k, a in flat.items()),
                            metadata=meta, overwrite=True, extra_files=tok)


def check_export_destination(run_dir: str | os.PathLike,
                             init_from: str | os.PathLike | None) -> None:
    """Before a run computes anything, and again before its export: ``RUN_DIR/model`` may
    replace an earlier export, never the folder the run's weights are read from
    (``--init-from RUN_DIR/model`` was silently overwritten by the run's own export), nor be
    written inside it or among its scratch siblings (``model.kdsa-*``). The folder read is the
    one ``init_from`` names (``kdsa.model.folders.locate``: a run directory names its newest
    step), so a run directory nested in the run it starts from is fine."""
    if init_from is None:
        return
    export = (Path(run_dir) / "model").absolute()
    try:
        read = ckpt.locate(init_from)[0].resolve()
    except ValueError:  # (no such folder: loading it says so)
        return
    if write_overlap(export, read) is not None:
        raise DestinationError(f"{export}: the run's export would be written over or into "
                               f"{read}, the folder its weights start from; use another "
                               f"--run-dir, or start from a copy")


def export_run(run_dir: str | os.PathLike, config: ModelConfig, graphdef, state, *, step: int,
               init_from: str | os.PathLike | None, export_experts: str | None, log) -> Path:
    """The end of a finished ``train`` / ``rl`` run: :func:`export_model` with the run's
    expert format (:func:`export_format`), ``init_from``'s tokenizer, the step in the
    metadata; says where."""
    check_export_destination(run_dir, init_from)  # (a resumed run's recorded origin)
    path = export_model(run_dir, config, graphdef, state,
                        experts=export_format(init_from, export_experts),
                        tokenizer_from=init_from,
                        metadata={"training": {"step": int(step), "init_from": init_from and
                                               str(init_from)}})
    log(f"model written to {path}")
    return path
