"""Train step: exact gradient accumulation, indexer stages, routing-bias update, optimizer parts,
data packing, metrics encoding. A 2-layer tiny model (KDA + Gated DSA with MoE) keeps compiles
short; the jitted step is shared between tests through its cache."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kdsa.model.config import get_preset
from kdsa.model.transformer import Transformer, abstract_model
from kdsa.train.config import TrainConfig, apply_train_overrides
from kdsa.train.data import _from_rows, pack_documents
from kdsa.train.optim import learning_rate_schedule, make_optimizer, matrix_dims
from kdsa.train.step import (init_state, split_model, token_cross_entropy, train_step,
                             update_routing_biases)


def small_config():
    cfg = get_preset("tiny")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, attn_res_block_size=None, linear_attn_config=lac)


@pytest.fixture(scope="module")
def model():
    return Transformer(small_config(), rngs=nnx.Rngs(0))


def _batch(cfg, b=4, t=16):
    ids = jax.random.randint(jax.random.key(1), (b, t + 1), 0, cfg.vocab_size)
    lengths = np.array([16, 3, 9, 12])  # uneven valid tokens per row / micro-batch
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.asarray(mask)}


# eps=1e-3: Adam's first step is smooth in the gradient, so tiny gradients cannot flip signs
BASE = TrainConfig(steps=10, batch_size=4, seq_len=16, warmup_steps=0, learning_rate=1e-2,
                   eps=1e-3, bias_update_rate=0.01)


def _flat(state):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
            jax.tree_util.tree_flatten_with_path(state)[0]}


def _run(model, tc, batch):
    _, params, _ = split_model(model, tc)
    tx = make_optimizer(tc, params)
    graphdef, state = init_state(model, tc, tx)
    return state, *train_step(graphdef, state, batch, tc=tc, tx=tx, layout=model.segment_layout)


def test_cross_entropy_matches_numpy():
    logits = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
    tg = np.array([[0, 4, 2], [1, 1, 3]])
    mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    ce = lse - np.take_along_axis(logits, tg[..., None], -1)[..., 0]
    s, n = token_cross_entropy(jnp.asarray(logits), jnp.asarray(tg), jnp.asarray(mask))
    np.testing.assert_allclose(float(s), (ce * mask).sum(), rtol=1e-6)
    assert float(n) == 4.0


def test_accumulation_equals_large_batch(model):
    """4 micro-batches with different valid-token counts == one batch: loss, grads, params."""
    cfg = model.config
    batch = _batch(cfg)
    base = BASE
    s0, s1, m1 = _run(model, base, batch)
    _, s4, m4 = _run(model, base.replace(accum_steps=4), batch)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=2e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert float(m1["tokens"]) == 40.0
    p1, p4, p0 = _flat(s1.params), _flat(s4.params), _flat(s0.params)
    moved = max(np.abs(p1[k] - p0[k]).max() for k in p1)
    assert moved > 5e-3  # the step did move parameters (lr 1e-2)
    for k in p1:
        np.testing.assert_allclose(p4[k], p1[k], atol=2e-5, rtol=0, err_msg=k)
    r1, r4, r0 = _flat(s1.rest), _flat(s4.rest), _flat(s0.rest)
    biases = [k for k in r1 if "e_score_correction_bias" in k]
    assert biases and all(np.array_equal(r1[k], r4[k]) for k in biases)
    assert any(not np.array_equal(r1[k], r0[k]) for k in biases)  # biases moved, not by Adam
    assert int(s1.step) == 1 and float(m1["learning_rate"]) == pytest.approx(1e-2)


def test_dense_warmup_trains_only_the_indexer(model):
    cfg = model.config
    tc = TrainConfig(steps=10, batch_size=4, seq_len=16, warmup_steps=0, learning_rate=1e-2,
                     indexer_stage="dense_warmup")
    s0, s1, m = _run(model, tc, _batch(cfg))
    p0, p1 = _flat(s0.params), _flat(s1.params)
    assert p0 and all("indexer" in k for k in p0)  # the optimizer's wrt is the indexer alone
    assert all(not np.array_equal(p0[k], p1[k]) for k in p0)
    assert float(m["indexer_kl"]) > 0
    r0, r1 = _flat(s0.rest), _flat(s1.rest)
    assert all(np.array_equal(r0[k], r1[k]) for k in r0)  # everything else, biases included


def test_routing_bias_update_per_layer():
    layout = ((0, 1, 1), (1, 2, 3))  # layer 0 alone; layers 1..6 as 3 repeats of period 2
    rest = nnx.State({"segments": {1: {"layers": {1: {"block_sparse_moe": {"gate": {
        "e_score_correction_bias": jnp.zeros((3, 4))}}}}}}})
    load = np.zeros((3, 4), np.float32)  # [L_moe, E]: the layers with a bias, in layer order
    load[0] = [4, 0, 0, 0]  # segment 1, position 1, repeat 0 -> layer 1 + 1 + 0 = 2
    load[1] = [1, 1, 1, 1]  # repeat 1 -> layer 4 (balanced: no move)
    load[2] = [0, 0, 2, 2]  # repeat 2 -> layer 6
    new = update_routing_biases(rest, jnp.asarray(load), layout, 0.5)
    got = np.asarray(new["segments"][1]["layers"][1]["block_sparse_moe"]["gate"][
        "e_score_correction_bias"])
    np.testing.assert_array_equal(got, [[-0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0],
                                        [0.5, 0.5, -0.5, -0.5]])


def test_schedule_and_clipping():
    tc = TrainConfig(steps=100, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
    lr = learning_rate_schedule(tc)
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    # cosine: end + (peak - end) * (1 + cos(pi * (s - w) / (D - w))) / 2
    want = 0.1 + 0.9 * (1 + np.cos(np.pi * 45 / 90)) / 2
    assert float(lr(55)) == pytest.approx(want, rel=1e-5)
    assert float(lr(100)) == pytest.approx(0.1, rel=1e-5)
    clip = optax.clip_by_global_norm(1.0)
    g = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}  # global norm 5
    out, _ = clip.update(g, clip.init(g))
    np.testing.assert_allclose(out["a"], [0.6, 0.0], rtol=1e-6)


def test_muon_dims_and_orthogonal_update():
    assert matrix_dims(("segments", "0", "kernel"), ("layers", "embed", "heads"), 3) == (1, 2)
    assert matrix_dims(("experts_w1",), ("layers", "experts", "embed", "mlp"), 4) == (2, 3)
    assert matrix_dims(("norm", "weight"), ("layers", None), 2) is None  # stacked vector
    assert matrix_dims(("embed_tokens", "embedding"), ("vocab", "embed"), 2) is None
    w = nnx.Param(jnp.zeros((2, 8, 6)), axes=("layers", "embed", "mlp"))
    b = nnx.Param(jnp.zeros((6,)), axes=(None,))
    params = nnx.State({"w": w, "b": b})
    tc = TrainConfig(optimizer="muon", learning_rate=1.0, clip_norm=0.0, weight_decay=0.0,
                     warmup_steps=0, schedule="constant", muon_consistent_rms=None)
    tx = make_optimizer(tc, params)
    pure = nnx.as_pure(params)
    g = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.ndim), x.shape), pure)
    upd, _ = tx.update(g, tx.init(pure), pure)
    sv = np.linalg.svd(-np.asarray(upd["w"]), compute_uv=False)  # [2, 6] per stacked layer
    assert sv.shape == (2, 6)  # orthogonalised per layer, not across the layer axis
    assert np.all(sv > 0.5) and np.all(sv < 1.6), sv  # Newton-Schulz: singular values ~1


def test_train_config_errors_and_overrides():
    tc = apply_train_overrides(TrainConfig(), ["learning_rate=1e-3", "train.optimizer=muon"])
    assert tc.learning_rate == 1e-3 and tc.optimizer == "muon"
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(batch_size=6, accum_steps=4)
    with pytest.raises(ValueError, match="indexer_stage"):
        TrainConfig(indexer_stage="warm")
    with pytest.raises(ValueError, match="unknown train config field"):
        apply_train_overrides(TrainConfig(), ["lr=1"])


def test_packing_and_loss_mask():
    docs = [np.array([1, 2, 3]), np.array([10, 11, 12, 13, 14]), np.array([20, 21])]
    tok, seg = pack_documents(docs, 6)
    np.testing.assert_array_equal(tok, [[1, 2, 3, 0, 0, 0], [10, 11, 12, 13, 14, 0],
                                        [20, 21, 0, 0, 0, 0]])
    np.testing.assert_array_equal(seg, [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0],
                                        [1, 1, 0, 0, 0, 0]])
    tok, seg = pack_documents([np.array([1, 2]), np.array([3, 4, 5]), np.array([6] * 8)], 6)
    np.testing.assert_array_equal(seg[0], [1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(seg[1], [1, 1, 1, 1, 1, 1])  # long document split
    b = _from_rows(tok, seg)
    np.testing.assert_array_equal(b["loss_mask"][0], [1, 0, 1, 1, 0])  # no cross-doc target


def _events(path):
    """The ``Event`` protos of a TFRecord file (``uint64 length, uint32 crc, data, uint32
    crc``), parsed with the proto classes tensorboardX ships."""
    from tensorboardX.proto.event_pb2 import Event

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 8], "little")
        ev = Event()
        ev.ParseFromString(data[i + 12:i + 12 + n])
        out.append(ev)
        i += 12 + n + 4
    return out


def test_tensorboard_scalars_and_resume(tmp_path):
    """Scalars land as ``train/<name>`` at their steps; a resumed writer starts its file with a
    SessionLog START at the resumed step + 1 (TensorBoard drops older events from there)."""
    from kdsa.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        w.write(step, {"loss": 1.0 / step, "skipped": float("nan")})
    w.close()
    first = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(first) == 1
    scalars = [(e.step, v.tag, v.simple_value) for e in _events(first[0]) for v in e.summary.value]
    assert scalars == [(1, "train/loss", 1.0), (2, "train/loss", 0.5),
                       (3, "train/loss", pytest.approx(1 / 3))]
    w = MetricsWriter(tmp_path, resume_step=2)
    w.write(3, {"loss": 0.25})
    w.close()
    second = [f for f in tmp_path.glob("events.out.tfevents.*") if f not in first]
    assert len(second) == 1
    evs = _events(second[0])
    starts = [e.step for e in evs if e.HasField("session_log") and e.session_log.status == 1]
    assert starts == [3]
    assert [(e.step, v.simple_value) for e in evs for v in e.summary.value] == [(3, 0.25)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_bf16_compute_with_remat_keeps_f32_master_weights(model):
    """compute_dtype=bfloat16, param_dtype=float32, remat_policy=full: one step of the same
    model (same weights) as the f32 run; parameters stay f32, loss within bf16 rounding."""
    cfg = model.config.replace(compute_dtype="bfloat16", remat_policy="full")
    m16 = Transformer(cfg, rngs=nnx.Rngs(0))
    nnx.update(m16, nnx.state(model))  # identical f32 master weights
    _, s16, m_16 = _run(m16, BASE, _batch(cfg))
    _, _, m_32 = _run(model, BASE, _batch(cfg))  # compiled already by the accumulation test
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(s16.params))
    assert abs(float(m_16["loss"]) - float(m_32["loss"])) < 3e-2  # measured 6.6e-4
    assert float(m_16["grad_norm"]) == pytest.approx(float(m_32["grad_norm"]), rel=0.1)


def test_cli_reports_config_errors_before_building(tmp_path, capsys):
    from kdsa.cli.main import main

    rc = main(["train", "--run-dir", str(tmp_path), "--train-set", "accum_steps=3"])
    assert rc == 2 and "accum_steps" in capsys.readouterr().err
    rc = main(["train", "--run-dir", str(tmp_path), "--set", "mla_use_nope=false",
               "--train-set", "seq_len=5000"])  # RoPE: positions end at the limit
    assert rc == 2 and "max_position_embeddings" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


def test_muon_partition_of_the_model_parameters():
    """Muon on every weight matrix of the model (stacked layers and experts as batch axes),
    AdamW on the embedding, the head, norms and vectors; checked on the abstract model."""
    from kdsa.train.optim import muon_dims_tree

    abstract = abstract_model(small_config())
    _, params, _ = split_model(abstract, TrainConfig())
    dims = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        muon_dims_tree(params), is_leaf=lambda x: x is None or isinstance(x, tuple))[0]}
    shapes = {jax.tree_util.keystr(p): v.shape for p, v in
              jax.tree_util.tree_flatten_with_path(nnx.as_pure(params))[0]}
    assert dims.keys() == shapes.keys()
    for name, d in dims.items():
        if "embed_tokens" in name or "lm_head" in name:
            assert d is None, name
        elif name.endswith("['kernel']"):
            assert d is not None and d.output_axis == len(shapes[name]) - 1, name
    experts = [n for n in dims if "experts" in n and "w1" in n]
    assert experts and all(len(shapes[n]) == 4 and tuple(dims[n]) == (2, 3) for n in experts)
    assert any(d is None for n, d in dims.items() if "norm" in n)
    tx = make_optimizer(TrainConfig(optimizer="muon"), params)
    jax.eval_shape(tx.init, nnx.as_pure(params))  # the dims tree matches the parameter tree


def test_weight_decay_reaches_matrices_not_stacked_norms_or_vectors():
    """AdamW's weight decay on matrices, embeddings and expert weights only. A scanned stack
    gives every layer parameter a leading ``layers`` axis, and the old rule (``ndim >= 2``)
    decayed every stacked norm weight, bias and KDA ``A_log`` / ``dt_bias``: zero gradients,
    one update, and they moved."""
    from kdsa.train.optim import decay_tree

    abstract = abstract_model(small_config())
    tc = TrainConfig(weight_decay=0.5, learning_rate=0.1, schedule="constant", warmup_steps=0,
                     clip_norm=0.0)
    _, params, _ = split_model(abstract, tc)
    names = {jax.tree_util.keystr(p): d for p, d in
             jax.tree_util.tree_flatten_with_path(decay_tree(params))[0]}
    shapes = {jax.tree_util.keystr(p): v.shape for p, v in
              jax.tree_util.tree_flatten_with_path(nnx.as_pure(params))[0]}
    assert names.keys() == shapes.keys()
    vectors = [n for n in names if any(k in n for k in ("norm", "A_log", "dt_bias", "bias'"))]
    stacked = [n for n in vectors if len(shapes[n]) >= 2]
    assert stacked and not any(names[n] for n in vectors), [n for n in vectors if names[n]]
    assert all(names[n] for n in names if n.endswith("['kernel']") or "embed_tokens" in n
               or "['experts']" in n), [n for n in names if not names[n]]
    pure = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), nnx.as_pure(params))
    tx = make_optimizer(tc, params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, pure), tx.init(pure), pure)
    moved = {jax.tree_util.keystr(p): float(jnp.abs(u).max()) for p, u in
             jax.tree_util.tree_flatten_with_path(updates)[0]}
    assert all(moved[n] == 0.0 for n in vectors) and all(moved[n] > 0 for n in names
                                                         if names[n])
