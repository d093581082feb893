"""Parameter counts from abstract shapes, and the ``kdsa params`` command."""

import json
import math

from flax import nnx

from kdsa.cli.main import main
from kdsa.model.config import get_preset
from kdsa.model.count import count_params
from kdsa.model.transformer import Transformer


def test_tiny_count_equals_instantiated_model():
    cfg = get_preset("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    real = sum(math.prod(v.shape) for v in jax_leaves(nnx.state(model, nnx.Variable)))
    r = count_params(cfg)
    assert r.total_params == real
    assert r.active_params == real - r.components["routed_experts"] + round(
        r.components["routed_experts"] * cfg.num_experts_per_token / cfg.num_experts)


def test_abstract_model_is_kept_per_config_and_each_caller_gets_its_own_variables():
    """``abstract_model`` traces the constructor once per config; later calls get fresh modules
    and ``Variable`` objects with the same shapes, so one caller's change reaches no other."""
    import jax

    from kdsa.model.transformer import _abstract_parts, abstract_model

    cfg = get_preset("tiny")
    real = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Variable)
    _abstract_parts.cache_clear()
    a, b = abstract_model(cfg), abstract_model(cfg)
    assert _abstract_parts.cache_info().misses == 1 and _abstract_parts.cache_info().hits == 1
    flat_a, flat_b = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b] == [
        p for p, _ in nnx.to_flat_state(real)]
    for (_, va), (_, vb), (_, vr) in zip(flat_a, flat_b, nnx.to_flat_state(real)):
        assert va is not vb and isinstance(va.get_value(), jax.ShapeDtypeStruct)
        assert (va.shape, va.dtype) == (vb.shape, vb.dtype) == (vr.shape, vr.dtype)
    a.embed_tokens.embedding.set_value(None)  # one caller's change
    assert isinstance(abstract_model(cfg).embed_tokens.embedding.get_value(),
                      jax.ShapeDtypeStruct)
    other = abstract_model(cfg.replace(vocab_size=cfg.vocab_size * 2))  # another config
    assert other.embed_tokens.embedding.shape[0] == 2 * cfg.vocab_size
    assert _abstract_parts.cache_info().misses == 2


def jax_leaves(state):
    import jax
    return jax.tree.leaves(state)


def test_k3_totals_match_published_size():
    r = count_params(get_preset("k3-2.8t"))
    assert abs(r.total_params / 2.8e12 - 1) < 0.03, r.total_params
    assert abs(r.active_params / 104e9 - 1) < 0.03, r.active_params
    assert r.num_kda_layers == 69 and r.num_dsa_layers == 24
    # routed experts dominate (97% of the weights) and MXFP4 shrinks them to 4.25 bits
    assert r.components["routed_experts"] / r.total_params > 0.95
    assert r.weight_bytes_mxfp4_experts < 0.3 * r.weight_bytes_bf16
    # per token per DSA layer (bf16): 512 latent + 64 rope + 128 indexer key = 1408 B
    assert r.cache_bytes_per_token == 24 * (512 + 64 + 128) * 2
    assert r.components["dsa_indexer"] > 0 and r.components["attn_res"] > 0


def test_kimi_linear_48b_size():
    r = count_params(get_preset("kimi-linear-48b"))
    assert abs(r.total_params / 48e9 - 1) < 0.05, r.total_params
    assert abs(r.active_params / 3e9 - 1) < 0.2, r.active_params  # "A3B"; ours counts embeddings
    assert r.components["dsa_indexer"] == 0 and r.components["attn_res"] == 0


def test_params_cli_json(capsys):
    assert main(["params", "--preset", "k3-2.8t", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_params"] > 2.7e12 and d["active_params"] > 1e11
    assert main(["params", "--preset", "tiny", "--set", "num_experts=16", "--context",
                 "1000"]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "decode cache at 1,000 tokens" in out


def test_params_cli_errors(capsys, tmp_path):
    assert main(["params", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["params", "--set", "num_experts_per_token=99"]) == 2
    assert "exceeds num_experts" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    assert main(["params", "--config", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    good = tmp_path / "config.json"
    good.write_text(get_preset("tiny").to_json())
    assert main(["params", "--config", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] > 0


def test_mxfp4_experts_count_logical_weights():
    """Packed MXFP4 experts (uint8 bytes + scales) count as the weights they encode."""
    bf16 = count_params(get_preset("k3-2.8t"))
    packed = count_params(get_preset("k3-2.8t").replace(expert_weight_format="mxfp4"))
    assert packed.components == bf16.components
    assert packed.active_params == bf16.active_params


def test_mfu_counts_the_parameters_a_token_multiplies_by():
    """MFU's ``6 N``: the input embedding is a row lookup (counting it overstated k3-slice's
    model FLOPs by 9.5%) unless it is also the head (tied); the vision tower and projector run
    on image patches, not on text tokens."""
    cfg = get_preset("tiny")
    r = count_params(cfg)
    assert r.matmul_params == r.active_params - cfg.vocab_size * cfg.hidden_size
    tied = count_params(cfg.replace(tie_word_embeddings=True))
    assert tied.matmul_params == tied.active_params
    vl = get_preset("tiny-vl")
    r = count_params(vl)
    assert r.components["vision_tower"] > 0 and r.matmul_params == (
        r.active_params - vl.vocab_size * vl.hidden_size - r.components["vision_tower"]
        - r.components["mm_projector"])
