"""Checkpoint conversion (``train/convert/pipeline.py``, ``train/mappings``), safetensors I/O and the MXFP4
expert model.

Golden: tiny Kimi Linear / DeepSeek-V3.2 models saved by transformers (``tests/data``,
``make_golden.py``) convert and reproduce transformers' logits. Round trips: hf -> orbax -> hf
gives the same tensors (bytes, names, dtypes), and our own export is a byte-identical fixed
point. Models are never initialised eagerly here (slow on CPU): random parameters are saved
with ``save_params`` and restored with ``load_model``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import YarnConfig, get_preset
from kdsa.model.moe import MoE, experts_one_hot, experts_ragged
from kdsa.model.moe_mxfp4 import pack_expert_weight, unpack_expert_weight
from kdsa.model.mxfp4 import fake_quantize_mxfp4
from kdsa.model.stacked_experts import PackedMatrix
from kdsa.sharding.rules import layout_shardings
from kdsa.train import convert
from model_fixtures import MICRO, random_params
from kdsa.train.convert.safetensors_io import (SafetensorsCheckpoint, SafetensorsError, SafetensorsFile,
                                       TensorSpec, write_checkpoint)

DATA = Path(__file__).parent / "data"
LAYOUTS = ("kimi_linear", "deepseek_v32")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
_fwd = nnx.jit(lambda model, ids: model(ids))  # one compile per model structure


_LOGITS: dict = {}


def logits(path, mesh=None):
    if (path, mesh) not in _LOGITS:
        _, model = ckpt.load_model(path, layout_shardings(mesh, "train"))
        _LOGITS[path, mesh] = np.asarray(_fwd(model, IDS))
    return _LOGITS[path, mesh]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def micro(work):
    """The micro K3 model (float experts) as Orbax, and exported in the kimi_k3 layout."""
    src = ckpt.save_params(work / "micro", MICRO, random_params(MICRO, 0))
    convert.orbax_to_hf(src, work / "micro_hf", layout="kimi_k3", progress=False)
    return src, work / "micro_hf"


def tensors(path) -> dict:
    c = SafetensorsCheckpoint(path)
    return {n: (c.info(n).dtype, c.info(n).shape, c.tensor(n).tobytes()) for n in c.names()}


def files(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


# ----------------------------------------------------------------------------- golden

@pytest.mark.parametrize("layout", LAYOUTS)
def test_golden_logits_and_round_trip(work, layout):
    """transformers' logits (measured max abs error 2.7e-7 Kimi Linear, 9e-8 DeepSeek-V3.2,
    logits up to 0.45); hf -> orbax -> hf keeps every tensor byte for byte; re-export is a
    byte-identical fixed point."""
    dst = work / f"{layout}_orbax"
    s = convert.hf_to_orbax(DATA / layout, dst, progress=False)
    assert s.layout == layout and s.tensors == len(SafetensorsCheckpoint(DATA / layout).names())
    golden = np.load(DATA / layout / "golden.npz")
    _, model = ckpt.load_model(dst)
    got = np.asarray(_fwd(model, jnp.asarray(golden["input_ids"])))
    np.testing.assert_allclose(got, golden["logits"], atol=3e-6, rtol=0)
    convert.orbax_to_hf(dst, work / f"{layout}_hf", progress=False)
    assert tensors(work / f"{layout}_hf") == tensors(DATA / layout)
    # every field of the source's config.json travels along (transformers_version, layer_types,
    # rope_parameters, ...; a nested dict may gain our keys)
    source = json.loads((DATA / layout / "config.json").read_text())
    exported = json.loads((work / f"{layout}_hf" / "config.json").read_text())
    assert {k: ({j: exported[k].get(j) for j in v} if isinstance(v, dict) else exported.get(k))
            for k, v in source.items()} == source
    convert.hf_to_orbax(work / f"{layout}_hf", work / f"{layout}_orbax2", progress=False)
    convert.orbax_to_hf(work / f"{layout}_orbax2", work / f"{layout}_hf2", progress=False)
    assert files(work / f"{layout}_hf2") == files(work / f"{layout}_hf")


def test_exported_config_rewrites_the_source_fields_our_config_decides():
    """Over a source config.json, what our config decides is rewritten from it: fewer layers
    (``--allow-partial``) change ``layer_types`` / ``mlp_layer_types`` in the source's words,
    YaRN goes into ``rope_parameters``, multi-token-prediction layers (not exported) become 0,
    and the MXFP4 ``quantization_config`` of a source goes with bfloat16 experts."""
    from kdsa.train.convert import mappings as mp
    from kdsa.train.convert.plan import config_from_hf

    for layout, full_word in (("kimi_linear", "full_attention"),
                              ("deepseek_v32", "indexed_attention")):
        source = json.loads((DATA / layout / "config.json").read_text())
        source.update(num_nextn_predict_layers=1, auto_map={"AutoConfig": "x.Config"},
                      quantization_config={"quant_method": "compressed-tensors"})
        config = config_from_hf(source, layout=layout)
        kda = (1,) if layout == "kimi_linear" else ()
        config = config.replace(
            num_hidden_layers=2, rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=64),
            linear_attn_config=dataclasses.replace(
                config.linear_attn_config, kda_layers=kda,
                full_attn_layers=tuple(i for i in (1, 2) if i not in kda)))
        ours = mp.get_layout(layout).hf_config(config, "bf16", "float32")
        got = mp.with_source_fields(source, ours, config)
        kinds = [full_word] * 2 if layout == "deepseek_v32" else ["linear_attention", full_word]
        assert got["layer_types"] == kinds, got["layer_types"]
        assert got["mlp_layer_types"] == ["dense", "sparse"] and got["num_hidden_layers"] == 2
        assert got["num_nextn_predict_layers"] == 0 and got["auto_map"] == source["auto_map"]
        assert "quantization_config" not in got and got["dtype"] == "float32"
        if layout == "deepseek_v32":  # transformers 5's spelling of rope_theta + rope_scaling
            assert got["rope_parameters"] == dict(dataclasses.asdict(config.rope_scaling),
                                                  rope_theta=10000.0, rope_type="yarn")
        assert got["transformers_version"] == source["transformers_version"]
        # tensors the source lacked (a new indexer): its remote code would skip them
        assert "auto_map" not in mp.with_source_fields(source, ours, config, new_tensors=True)
    # a source nested otherwise than ours (a K3 wrapper against a flat config) gives nothing
    assert mp.with_source_fields({"text_config": source}, ours, config) == ours


def test_export_keeps_source_names_with_mxfp4_experts_and_takes_an_explicit_dtype(work):
    """Exporting in another expert format keeps the other tensors' source names and dtypes
    (they were renamed to our defaults and, for the layout's float32 tensors, retyped); an
    explicit ``--dtype`` replaces the recorded float dtypes (it was ignored: the config said
    float32 over bfloat16 tensors)."""
    dst = work / "kimi_linear_names"
    convert.hf_to_orbax(DATA / "kimi_linear", dst, progress=False)
    src = SafetensorsCheckpoint(DATA / "kimi_linear")
    others = lambda c: {n: c.info(n).dtype for n in c.names() if ".experts." not in n}  # noqa
    convert.orbax_to_hf(dst, work / "kimi_linear_mx", experts="mxfp4", progress=False)
    mx = SafetensorsCheckpoint(work / "kimi_linear_mx")
    assert others(mx) == others(src)
    assert any(n.endswith("_packed") for n in mx.names())  # the experts in MXFP4
    # a compressed-tensors loader quantizes every Linear its ignore list does not name: each
    # float Linear written must be named (the dense FFN, saved as block_sparse_moe.*_proj by
    # transformers 5.18, was not; the embedding and the router are not Linears)
    ignore = json.loads((work / "kimi_linear_mx" / "config.json").read_text())[
        "quantization_config"]["ignore"]
    linears = [n[:-len(".weight")] for n in mx.names() if n.endswith(".weight")
               and len(mx.info(n).shape) == 2 and not n.endswith(("embed_tokens.weight",
                                                                  "block_sparse_moe.gate.weight"))]
    unnamed = [m for m in linears if not any(
        re.fullmatch(p[3:], m) if p.startswith("re:") else p == m for p in ignore)]
    assert linears and not unnamed, unnamed
    convert.orbax_to_hf(dst, work / "kimi_linear_f32", dtype="float32", progress=False)
    f32 = SafetensorsCheckpoint(work / "kimi_linear_f32")
    assert {f32.info(n).dtype for n in f32.names()} == {"F32"}
    assert set(f32.names()) == set(src.names())
    assert json.loads((work / "kimi_linear_f32" / "config.json").read_text())[
        "torch_dtype"] == "float32"
    # a source whose A_log was float32 among bfloat16 tensors (as published ones keep routing
    # biases and A_log): an explicit --dtype replaces the main dtype and keeps that exception
    meta_file = dst / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    hf_dtypes = meta["custom_metadata"]["kdsa"]["hf_dtypes"]
    a_log = next(k for k in hf_dtypes if k.endswith("A_log"))
    hf_dtypes[a_log] = "F32"
    meta_file.write_text(json.dumps(meta))
    convert.orbax_to_hf(dst, work / "kimi_linear_f16", dtype="float16", progress=False)
    f16 = SafetensorsCheckpoint(work / "kimi_linear_f16")
    assert {n: f16.info(n).dtype for n in f16.names() if n.endswith("A_log")} == {
        n: "F32" for n in src.names() if n.endswith("A_log")}
    assert {f16.info(n).dtype for n in f16.names() if not n.endswith("A_log")} == {"F16"}


# ----------------------------------------------------------------------------- K3 layout

def test_k3_round_trip_and_logits_on_one_device_and_a_mesh(work, micro):
    src, hf = micro
    names = SafetensorsCheckpoint(hf).names()
    assert all(n.startswith("language_model.") for n in names)
    assert any(".self_attn.indexer.wq_b.weight" in n for n in names)  # our K3+DSA export
    back = work / "micro_back"
    convert.hf_to_orbax(hf, back, progress=False)
    convert.orbax_to_hf(back, work / "micro_hf2", progress=False)
    assert files(work / "micro_hf2") == files(hf)
    want = logits(src)
    np.testing.assert_array_equal(logits(back), want)
    from kdsa.sharding.mesh import make_mesh

    mesh = make_mesh("fsdp=2,expert=2,tensor=2")
    _, model = ckpt.load_model(back, layout_shardings(mesh, "train"))
    w1 = model.segments[1].layers[0].block_sparse_moe.experts.w1[...]
    assert len(w1.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(_fwd(model, IDS)), want, atol=2e-5, rtol=0)
    # the same conversion placed straight onto the mesh (make_array_from_callback)
    convert.hf_to_orbax(hf, work / "micro_mesh", mesh=mesh, progress=False)
    for (k, a), (_, b) in zip(ckpt.iter_params(back, MICRO), ckpt.iter_params(work / "micro_mesh",
                                                                              MICRO)):
        np.testing.assert_array_equal(a, b, err_msg=k)


def test_k3_a_log_in_the_published_shape(work, micro):
    """kimi_k3 writes A_log as [max(H, head_dim)] (the published K3: [128] for 96 heads of
    head_dim 128, kimi_k3.md section 2): our H values, then zeros for a model of ours. A source
    with its own values past H converts with the first H (vLLM / FLA) and exports its bytes
    back unchanged."""
    from kdsa.train.convert.mappings import a_log_hf_len

    assert a_log_hf_len(get_preset("k3-2.8t")) == 128
    src, hf = micro
    h, dk = MICRO.linear_attn_config.num_heads, MICRO.linear_attn_config.head_dim
    name = "language_model.model.layers.0.self_attn.A_log"  # layer 1 is the KDA layer
    key = next(k for k in ckpt.flat_variables(nnx.state(ckpt.abstract_model(MICRO)))
               if k.endswith("self_attn.A_log"))
    ours = dict(ckpt.iter_params(src, MICRO, [key]))[key][0]                    # [H]
    a = np.array(SafetensorsCheckpoint(hf).tensor(name))
    assert a.shape == (max(h, dk),) == (16,) and a.dtype == np.float32
    np.testing.assert_array_equal(a[:h], ours)
    assert not a[h:].any()
    tail = np.random.default_rng(5).uniform(-1, 1, dk - h).astype(np.float32)
    with_tail = _copy_without(hf, work / "alog_src",
                              change={name: lambda a: np.concatenate([a[:h], tail])})
    convert.hf_to_orbax(with_tail, work / "alog_orbax", progress=False)
    np.testing.assert_array_equal(
        dict(ckpt.iter_params(work / "alog_orbax", MICRO, [key]))[key][0], ours)
    convert.orbax_to_hf(work / "alog_orbax", work / "alog_hf", progress=False)
    assert tensors(work / "alog_hf") == tensors(with_tail)
    short = _copy_without(hf, work / "alog_short", change={name: lambda a: a[:h - 1]})
    with pytest.raises(ValueError, match=rf"{name}: expected shape \[{h}\], found \[{h - 1}\]"):
        convert.hf_to_orbax(short, work / "alog_bad", dry_run=True, progress=False)


def test_mxfp4_experts_model(work, micro):
    """--experts mxfp4: packed uint8 experts, 4.25 bits/param, byte-identical MXFP4 round trip,
    logits near the float model's: relative RMS logit error measured 0.16 (max abs 0.94 with
    logits up to 4.5; random 2-layer model, routed output RMS-normed, MXFP4 round-to-nearest is
    ~19 dB SQNR per matrix); bound 0.3."""
    src, hf = micro
    q = work / "micro_q"
    convert.hf_to_orbax(hf, q, experts="mxfp4", progress=False)
    config, info = ckpt.read_info(q)
    assert config.expert_weight_format == "mxfp4"
    p = dict(ckpt.iter_params(q, config, ["segments.1.layers.0.block_sparse_moe.experts.w1_packed",
                                          "segments.1.layers.0.block_sparse_moe.experts.w1_scale"]))
    packed = p["segments.1.layers.0.block_sparse_moe.experts.w1_packed"]
    scale = p["segments.1.layers.0.block_sparse_moe.experts.w1_scale"]
    assert packed.dtype == np.uint8 and scale.dtype == np.uint8
    ratio = (packed.nbytes + scale.nbytes) / (packed.size * 2 * 2)
    assert ratio == pytest.approx(4.25 / 16)
    convert.orbax_to_hf(q, work / "micro_q_hf", progress=False)
    qt = tensors(work / "micro_q_hf")
    assert any(n.endswith("w1.weight_packed") for n in qt)
    convert.hf_to_orbax(work / "micro_q_hf", work / "micro_q2", progress=False)
    convert.orbax_to_hf(work / "micro_q2", work / "micro_q_hf2", progress=False)
    assert files(work / "micro_q_hf2") == files(work / "micro_q_hf")
    lq, lf = logits(q), logits(src)
    rel = np.sqrt(np.mean((lq - lf) ** 2) / np.mean(lf ** 2))
    assert 1e-3 < rel < 0.3, rel


def test_mxfp4_scales_as_f8_e8m0_and_nan_scales(work, micro):
    """Scales stored as ``F8_E8M0`` (the same bytes under their own dtype name) convert as
    ``U8`` ones do (they were refused). An E8M0 scale byte 0xFF (NaN) is an error naming the
    tensor and where, both when the packed bytes are kept and when they are dequantised (it
    was passed through, and every token routed to that expert got NaN)."""
    _, hf = micro
    convert.hf_to_orbax(hf, work / "nan_q", experts="mxfp4", progress=False)
    convert.orbax_to_hf(work / "nan_q", work / "nan_q_hf", progress=False)
    names = SafetensorsCheckpoint(work / "nan_q_hf").names()
    e8m0 = _copy_without(work / "nan_q_hf", work / "e8m0", change={
        n: (lambda a: a.view(ml_dtypes.float8_e8m0fnu)) for n in names if n.endswith("_scale")})
    convert.hf_to_orbax(e8m0, work / "e8m0_q", progress=False)
    config = ckpt.read_info(work / "nan_q")[0]
    keys = [k for k in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config)))
            if k.endswith("experts.w2_scale")]
    for (_, a), (_, b) in zip(ckpt.iter_params(work / "nan_q", config, keys),
                              ckpt.iter_params(work / "e8m0_q", config, keys)):
        np.testing.assert_array_equal(a, b)
    name = next(n for n in names if n.endswith("w1.weight_scale"))

    def nan_at_2_0(a):
        a[2, 0] = 0xFF
        return a

    bad = _copy_without(work / "nan_q_hf", work / "nan_bad", change={name: nan_at_2_0})
    for experts in ("mxfp4", "bf16"):
        with pytest.raises(ValueError, match=rf"{name}: E8M0 scale 0xFF \(NaN\) in row 2, block 0"):
            convert.hf_to_orbax(bad, work / f"nan_out_{experts}", experts=experts,
                                progress=False)


# ----------------------------------------------------------------------------- MoE pieces

def _moe_inputs(config, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    e, de, i = config.num_experts, config.expert_hidden_size, config.moe_intermediate_size
    w1 = jax.random.normal(k[0], (e, de, i)) / np.sqrt(de)
    w3 = jax.random.normal(k[1], (e, de, i)) / np.sqrt(de)
    w2 = jax.random.normal(k[2], (e, i, de)) / np.sqrt(i)
    z = jax.random.normal(k[3], (10, de))
    idx = jax.random.randint(k[4], (10, 2), 0, e)
    wt = jax.nn.softmax(jax.random.normal(k[4], (10, 2)))
    return z, idx, wt, (w1, w3, w2)


# packing and exact dequantisation as compiled programs, shared by both impls (op by op they are
# ~80 eager compiles)
_pack_all = jax.jit(lambda ws: [x for w in ws for x in pack_expert_weight(w)])
_unpack_all = jax.jit(lambda p: [unpack_expert_weight(p[2 * j], p[2 * j + 1]) for j in range(3)])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_mxfp4_experts_match_one_hot_reference(impl):
    """``experts_ragged`` on MXFP4 bytes (``PackedMatrix``: dequantised + ``ragged_dot`` / the
    grouped Pallas kernel in interpret mode) vs the one-hot dense reference on exactly
    dequantised weights: values and activation gradients (max rel error ~3e-7)."""
    c = MICRO.replace(expert_weight_format="mxfp4", moe_impl=impl)
    z, idx, wt, ws = _moe_inputs(c)
    packed = _pack_all(ws)
    deq = _unpack_all(packed)
    mats = [PackedMatrix(packed[j], packed[j + 1], impl) for j in (0, 2, 4)]
    f = lambda z: experts_ragged(z, idx, wt, *mats, c)  # noqa: E731
    g = lambda z: experts_one_hot(z, idx, wt, *deq, c)  # noqa: E731
    both = jax.jit(lambda z: (f(z), g(z), jax.grad(lambda z: jnp.sum(f(z) ** 2))(z),
                              jax.grad(lambda z: jnp.sum(g(z) ** 2))(z)))
    yf, yg, df, dg = both(z)
    np.testing.assert_allclose(yf, yg, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(df, dg, rtol=1e-4, atol=1e-5)


def test_mxfp4_pallas_experts_on_a_data_mesh_equal_one_device():
    """On a mesh without expert parallelism the Pallas experts run per device on its own token
    rows (``moe.experts_per_device``: a Mosaic call cannot be partitioned by XLA): the same
    outputs as on one device."""
    from kdsa.model.moe import experts_per_device
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import make_mesh

    c = MICRO.replace(expert_weight_format="mxfp4", moe_impl="pallas")
    z, idx, wt, ws = _moe_inputs(c)
    packed = _pack_all(ws)
    mats = [PackedMatrix(packed[j], packed[j + 1], "pallas") for j in (0, 2, 4)]
    want = jax.jit(lambda z: experts_ragged(z, idx, wt, *mats, c))(z)
    with use_sharding(make_mesh("data=2", devices=jax.devices()[:2]), "generate"):
        fn = lambda z: experts_per_device(z, idx, wt, *mats, c)  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(fn)(z))  # (XLA:CPU would partition it too)
        got = jax.jit(fn)(z)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_qat_layer_is_the_served_mxfp4_layer(impl):
    """Same init: the QAT MoE (float masters, fake-quantised) and the MXFP4 MoE compute the same
    layer: with ``moe_impl="xla"`` the packed bytes' exact dequantisation through the float
    experts' path (bitwise equal), with ``"pallas"`` the bytes through the grouped MXFP4 kernel
    (interpret mode)."""
    x = jax.random.normal(jax.random.key(3), (2, 6, MICRO.hidden_size))
    qat = MoE(MICRO.replace(expert_qat=True), rngs=nnx.Rngs(0))
    served = MoE(MICRO.replace(expert_weight_format="mxfp4", moe_impl=impl), rngs=nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x: m(x)[0])
    want, got = fwd(qat, x), fwd(served, x)
    if impl == "xla":
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_qat_gradient_is_straight_through():
    """QAT forward = float forward on dequant(quant(w)); its weight gradient equals the float
    model's gradient there (STE), so on-grid weights (nothing clips) get the float gradient
    (up to float32 rounding: two programs)."""
    c = MICRO.replace(expert_qat=True)
    z, idx, wt, ws = _moe_inputs(c, 1)
    from kdsa.model.moe_mxfp4 import qat_expert_weights

    def loss(ws, quant):
        ws = qat_expert_weights(*ws) if quant else ws
        return jnp.sum(experts_one_hot(z, idx, wt, *ws, c) ** 2)

    fq = jax.jit(lambda ws: tuple(fake_quantize_mxfp4(w, axis=-2) for w in ws))(ws)
    assert not np.allclose(fq[0], ws[0])
    grad = jax.jit(jax.grad(loss), static_argnums=1)  # one compile each, not op by op
    for a, b in zip(grad(ws, True), grad(fq, False)):  # (two programs: JAX 0.12.1 rounds
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # them 5e-7 apart)
    for a, b in zip(grad(fq, True), grad(fq, False)):  # on the grid: the same forward values
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # (bitwise under 0.12.0; 4e-6
        # apart under 0.12.1, the two programs' sums rounded apart)


def test_packed_experts_are_frozen_and_counted_logically():
    c = MICRO.replace(expert_weight_format="mxfp4")
    model = nnx.eval_shape(lambda: MoE(c, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    assert not any(".experts." in ckpt.flat_key(p) for p, _ in nnx.to_flat_state(params))
    counts = [v.get_metadata()["param_count"] for _, v in nnx.to_flat_state(nnx.state(model))
              if "param_count" in v.get_metadata()]
    e, de, i = c.num_experts, c.expert_hidden_size, c.moe_intermediate_size
    assert sum(counts) == 3 * e * de * i


# ----------------------------------------------------------------------------- errors

def _copy_without(src: Path, dst: Path, drop=(), add=None, change=None) -> Path:
    """Rewrite a golden folder's safetensors with tensors dropped / added / changed."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    c = SafetensorsCheckpoint(src)
    arrays = {n: np.array(c.tensor(n)) for n in c.names() if n not in drop}
    arrays.update(add or {})
    for n, f in (change or {}).items():
        arrays[n] = f(arrays[n])
    write_checkpoint(dst, [TensorSpec(n, a.dtype, a.shape, lambda a=a: a)
                           for n, a in arrays.items()], max_shard_bytes=1 << 30)
    return dst


BAD = {
    "missing": (dict(drop=["model.layers.2.self_attn.kv_b_proj.weight"]), "1 missing tensor"),
    "unexpected": (dict(add={"model.layers.1.extra.weight": np.zeros(3, np.float32)}),
                   "unexpected tensor(s): model.layers.1.extra.weight"),
    "shape": (dict(change={"model.norm.weight": lambda a: a[:5]}),
              "model.norm.weight: expected shape [32], found [5]"),
    "dtype": (dict(change={"lm_head.weight": lambda a: a.astype(np.int32)}),
              "lm_head.weight: expected dtype a float type, found I32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tensors_fail_before_writing(work, case, capsys):
    kw, message = BAD[case]
    src = _copy_without(DATA / "deepseek_v32", work / f"bad_{case}", **kw)
    dst = work / f"bad_{case}_out"
    from kdsa.cli.main import main

    assert main(["convert", "hf-to-orbax", str(src), str(dst), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not dst.exists() and not list(work.glob(f"bad_{case}_out*"))


def test_corrupt_and_truncated_safetensors(work):
    src = _copy_without(DATA / "kimi_linear", work / "corrupt")
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(f)
    f.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(SafetensorsError, match="corrupt safetensors header"):
        convert.hf_to_orbax(src, work / "corrupt_out", progress=False)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(f)
    assert not (work / "corrupt_out").exists()


def test_failed_conversion_keeps_previous_output(work, micro):
    _, hf = micro
    dst = work / "keep"
    convert.hf_to_orbax(DATA / "deepseek_v32", dst, progress=False)
    before = sorted(p.name for p in dst.rglob("*"))
    with pytest.raises(ValueError, match="does not match layout kimi_linear"):
        convert.hf_to_orbax(DATA / "deepseek_v32", dst, layout="kimi_linear", progress=False,
                            overwrite=True)
    assert sorted(p.name for p in dst.rglob("*")) == before
    assert ckpt.read_info(dst)[0].num_hidden_layers == 3
    assert [p.name for p in work.iterdir() if p.name.startswith("keep")] == ["keep"]


def test_dry_run_and_fresh_indexer(work, micro):
    """A K3 checkpoint without indexer tensors + a config asking for one: the indexer is
    initialised fresh and reported; dry runs validate and write nothing."""
    src, _ = micro
    no_idx = MICRO.replace(index_n_heads=None, index_head_dim=None, index_topk=None)
    k3 = ckpt.save_params(work / "k3_noidx", no_idx, random_params(no_idx, 1))
    convert.orbax_to_hf(k3, work / "k3_noidx_hf", layout="kimi_k3", progress=False)
    assert not any(".indexer." in n for n in SafetensorsCheckpoint(work / "k3_noidx_hf").names())
    s = convert.hf_to_orbax(work / "k3_noidx_hf", work / "k3_dry", config=MICRO, dry_run=True,
                            progress=False)
    assert s.dry_run and not (work / "k3_dry").exists()
    assert len(s.fresh) == 5 and all(".indexer." in k for k in s.fresh)
    s = convert.hf_to_orbax(work / "k3_noidx_hf", work / "k3_idx", config=MICRO, progress=False)
    config, info = ckpt.read_info(work / "k3_idx")
    assert config.use_indexer and info["fresh"] == s.fresh
    assert convert.orbax_to_hf(work / "k3_idx", work / "k3_dry_hf", dry_run=True,
                               progress=False).tensors > 0
    assert not (work / "k3_dry_hf").exists()


# ----------------------------------------------------------------------------- safetensors

def test_safetensors_against_the_reference_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "b": np.linspace(-2, 2, 7).astype(ml_dtypes.bfloat16),
              "c": np.arange(5, dtype=np.uint8), "d": np.zeros((0, 3), np.float16)}
    st.save_file(arrays, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "ref.safetensors")
    for n, a in arrays.items():
        assert f.tensor(n).dtype == a.dtype and np.array_equal(f.tensor(n), a)
    write_checkpoint(tmp_path, [TensorSpec(n, a.dtype, a.shape, lambda a=a: a)
                                for n, a in arrays.items()], max_shard_bytes=40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    got = {}
    for shard in set(index["weight_map"].values()):
        got.update(st.load_file(tmp_path / shard))
    for n, a in arrays.items():
        assert got[n].dtype == a.dtype and np.array_equal(got[n], a)
    index["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="does not hold it"):
        SafetensorsCheckpoint(tmp_path)
