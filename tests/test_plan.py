"""``kdsa plan``: per-device memory from the rules on abstract meshes, refusals, the CLI."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from kdsa.cli.main import main
from kdsa.model.config import get_preset
from kdsa.model.count import abstract_model, count_params
from kdsa.sharding.mesh import AXES, make_mesh
from kdsa.model.dsa_cache import dsa_cache_bytes_per_token
from kdsa.sharding.plan import layer_activation_elements, make_plan, parse_bytes
from kdsa.sharding.rules import replicated_report, state_shardings

GiB = 2 ** 30
TINY = get_preset("tiny")
K3 = get_preset("k3-2.8t")


@pytest.fixture(scope="module")
def tiny_abstract():
    return abstract_model(TINY)


@pytest.fixture(scope="module")
def k3_abstract():
    return abstract_model(K3)


def test_parse_bytes():
    assert parse_bytes("141GiB") == 141 * 2 ** 30
    assert parse_bytes("80 GB") == 80 * 10 ** 9
    assert parse_bytes("1e6") == 10 ** 6
    for bad in ("lots", "-3GiB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_parameter_bytes_match_jax_shard_shapes(tiny_abstract):
    """Independent path: the busiest device's bytes from ``NamedSharding.shard_shape`` of the
    rules' shardings on a real 8-device mesh."""
    sizes = dict(data=1, fsdp=2, expert=2, tensor=2, sequence=1)
    mesh = make_mesh(sizes)
    state = nnx.state(tiny_abstract)
    per_device = np.zeros(8)
    trainable = 0
    for (_, v), (_, s) in zip(nnx.to_flat_state(state),
                              nnx.to_flat_state(state_shardings(state, mesh, "train"))):
        nbytes = math.prod(s.shard_shape(v.shape)) * v.dtype.itemsize
        for dev in s.device_set:
            per_device[dev.id] += nbytes
        if isinstance(v, nnx.Param):
            trainable += math.prod(s.shard_shape(v.shape))
    plan = make_plan(TINY, "train", sizes, device_memory=GiB, batch=8, seq=32,
                     model=tiny_abstract)
    assert plan.memory["parameters"] == per_device.max() == per_device.min()
    assert plan.memory["gradients"] == 4 * trainable  # float32 parameters
    assert plan.memory["optimizer"] == 8 * trainable  # 2 moments; the master is the param
    assert plan.fits and plan.refusal() is None and plan.devices == 8
    # bfloat16 parameters: AdamW's moments in bfloat16 too (optax's default), no master copy
    bf16 = make_plan(TINY.replace(param_dtype="bfloat16"), "train", sizes, device_memory=GiB,
                     batch=8, seq=32)
    assert bf16.memory["optimizer"] == 2 * bf16.memory["gradients"] > 0


def test_activation_and_cache_terms_follow_their_formulas(tiny_abstract):
    sizes = dict(data=2, fsdp=1, expert=2, tensor=2, sequence=1)
    kw = dict(device_memory=GiB, seq=32, model=tiny_abstract)
    one = make_plan(TINY, "train", sizes, batch=8, **kw)
    two = make_plan(TINY, "train", sizes, batch=16, **kw)
    assert two.memory["activations"] == 2 * one.memory["activations"]  # linear in tokens
    accum = make_plan(TINY, "train", sizes, batch=16, accum_steps=2, **kw)  # micro-batch 8
    # one micro-batch's activations, and the gradient sum carried across them (it was left
    # out: XLA:TPU's temporaries grew 10x with accumulation while the plan stayed the same)
    assert accum.memory == {**one.memory, "accumulator": one.memory["gradients"]}
    assert one.memory["accumulator"] == 0 and accum.batch == 16
    assert accum.communication == {a: 2 * v for a, v in one.communication.items()}  # 2 passes
    with pytest.raises(ValueError, match="--accum-steps is the train layout's"):
        make_plan(TINY, "generate", sizes, batch=16, accum_steps=2, **kw)
    with pytest.raises(ValueError, match="--accum-steps 3 must be >= 1 and divide --batch 16"):
        make_plan(TINY, "train", sizes, batch=16, accum_steps=3, **kw)
    kinds = list(zip(TINY.mixer_kinds, TINY.ffn_kinds))
    per_token = sum(layer_activation_elements(TINY, m, f, 2) for m, f in kinds)
    assert one.memory["activations"] == per_token * (8 // 4) * 32 * 4  # no remat: all layers
    remat = make_plan(TINY.replace(remat_policy="full"), "train", sizes, batch=8, **kw)
    assert remat.memory["activations"] < one.memory["activations"]
    gen = make_plan(TINY, "generate", sizes, batch=8, **kw)
    report = count_params(TINY)
    b_l = 8 // 4  # requests over data x expert
    # KDA states (recurrent and conv window, all KDA layers) split over tensor = 2
    want = b_l * (report.cache_bytes_per_token * 32 + report.cache_bytes_per_sequence // 2)
    assert gen.memory["caches"] == want
    assert gen.memory["gradients"] == gen.memory["optimizer"] == 0
    assert set(gen.communication) == {"expert", "tensor"}


def test_weight_gathers_over_expert_are_counted(tiny_abstract):
    """In the train layout the non-expert weights shard over ``fsdp`` x ``expert``: their
    gathers move as many bytes over ``expert=8`` as over ``fsdp=8`` (the ``expert`` part was
    not counted: ``expert=8`` reported only the token all-to-all)."""
    kw = dict(device_memory=GiB, batch=8, seq=32, model=tiny_abstract)
    by_fsdp = make_plan(TINY, "train", dict(fsdp=8), **kw).communication
    by_expert = make_plan(TINY, "train", dict(expert=8), **kw).communication
    # reported under the axis they cross: on an expert-only mesh nothing under fsdp
    assert by_fsdp["fsdp"] > 0 and "fsdp" not in by_expert
    assert by_expert["expert"] > 0.5 * by_fsdp["fsdp"]  # the non-expert weights' gathers


def test_gathered_weights_term(tiny_abstract, k3_abstract):
    """Nothing sharded over fsdp / expert: nothing gathered. Sharded: at least the vocabulary
    projection whole three times (forward, backward, unsharded gradient); K3's largest unit
    is a layer repeat of its scanned group (twice its gathered weights)."""
    one = make_plan(TINY, "train", {}, device_memory=GiB, batch=8, seq=32, model=tiny_abstract)
    assert one.memory["gathered"] == 0
    sharded = make_plan(TINY, "train", dict(fsdp=2, expert=2), device_memory=GiB, batch=8,
                        seq=32, model=tiny_abstract)
    vocab_bytes = TINY.vocab_size * TINY.hidden_size * 4
    assert sharded.memory["gathered"] >= 3 * vocab_bytes
    gen = make_plan(TINY, "generate", dict(expert=2), device_memory=GiB, batch=8, seq=32,
                    model=tiny_abstract)
    assert gen.memory["gathered"] == 0
    k3 = make_plan(K3, "train", dict(fsdp=16, expert=64), device_memory=parse_bytes("141GiB"),
                   batch=1024, seq=8192, moe_capacity_factor=1.25, model=k3_abstract)
    assert k3.memory["gathered"] > 3 * K3.vocab_size * K3.hidden_size * 2  # bf16


def test_k3_train_on_1024_h200_fits_with_a_capacity_factor_and_on_256_is_refused(k3_abstract):
    """Dropless, the expert-parallel receive buffers are sized for every device's assignments
    landing on one owner (64 x the mean here) and alone exceed the device; with a capacity
    factor of 1.25 the layout fits."""
    sizes = dict(data=1, fsdp=16, expert=64, tensor=1, sequence=1)
    dropless = make_plan(K3, "train", sizes, device_memory=parse_bytes("141GiB"), batch=1024,
                         seq=8192, model=k3_abstract)
    assert not dropless.fits and "largest term: moe_dispatch" in dropless.refusal()
    m = 8192 * K3.num_experts_per_token  # assignments leaving each device (1 row of 8192)
    de, i = K3.expert_hidden_size, K3.moe_intermediate_size
    assert dropless.memory["moe_dispatch"] == 2 * 64 * m * (2 * de + 3 * i) * 2
    big = make_plan(K3, "train", sizes, device_memory=parse_bytes("141GiB"), batch=1024,
                    seq=8192, moe_capacity_factor=1.25, model=k3_abstract)
    assert big.fits
    assert big.memory["moe_dispatch"] == 2 * int(1.25 * m) * (2 * de + 3 * i) * 2
    total = count_params(K3).total_params
    assert big.memory["parameters"] == pytest.approx(2 * total / 1024, rel=0.1)
    small = make_plan(K3, "train", dict(data=1, fsdp=4, expert=64, tensor=1, sequence=1),
                      device_memory=parse_bytes("141GiB"), batch=256, seq=8192,
                      moe_capacity_factor=1.25, model=k3_abstract)
    assert not small.fits
    assert "largest term: activations" in small.refusal()


def test_no_large_k3_weight_is_left_whole_in_training(k3_abstract):
    mesh = jax.sharding.AbstractMesh((1, 16, 64, 1, 1), AXES)
    assert replicated_report(nnx.state(k3_abstract), mesh, "train", min_bytes=100 << 20) == []


def test_plan_cli_exit_codes(capsys):
    args = ["plan", "--preset", "tiny", "--mesh", "fsdp=2,expert=2,tensor=2", "--batch", "8",
            "--seq", "64"]
    assert main(args + ["--device-memory", "1GiB"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(args + ["--device-memory", "1MiB"]) == 3
    assert "REFUSED" in capsys.readouterr().out
    assert main(["plan", "--preset", "tiny", "--mesh", "expert=3", "--batch", "6"]) == 2
    assert "num_experts=8 is not divisible by mesh axes expert=3" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--layout", "generate"]) == 2
    assert "give --devices" in capsys.readouterr().err
    # the default batch with --accum-steps: a row per device in each micro-batch
    assert main(["plan", "--preset", "tiny", "--mesh", "fsdp=2,expert=2", "--accum-steps", "3",
                 "--seq", "64"]) == 0
    assert "batch=12 in 3 micro-batches" in capsys.readouterr().out


def test_plan_compile_reports_a_program_xla_refuses(capsys, monkeypatch):
    """XLA:TPU refusing a step for its HBM (what the whole K3's prefill step did before its slot
    read stopped gathering every slot) is a "does not fit" answer, exit 3, with XLA's message;
    the other step is still compiled. Any other compile error propagates."""
    import jax

    from kdsa.infer import aot

    def refuse(step):
        raise jax.errors.JaxRuntimeError(
            f"RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: temporaries of the {step} exceed "
            "available HBM\nmore")

    def fake(config, topology, sizes, *, slots, max_len, prefill_chunk, paged):
        return {step: lambda step=step: refuse(step) for step in ("prefill", "decode")}

    monkeypatch.setattr(aot, "generate_step_compiles", fake)
    args = ["plan", "--preset", "tiny", "--layout", "generate", "--mesh", "data=4", "--batch",
            "4", "--seq", "64", "--compile", "--topology", "v5e:2x2"]
    assert main(args) == 3
    out = capsys.readouterr().out
    for step in ("prefill", "decode"):
        assert (f"REFUSED: XLA:TPU would not compile the {step} for v5e:2x2: RESOURCE_EXHAUSTED: "
                f"E1000: CompileTimeHbmOom: temporaries of the {step} exceed available HBM\n") in out
    assert main(args + ["--json"]) == 3
    assert '"refused_by_xla"' in capsys.readouterr().out

    def host_oom():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: the host ran out of memory")

    monkeypatch.setattr(aot, "generate_step_compiles", lambda *a, **k: {"prefill": host_oom})
    with pytest.raises(jax.errors.JaxRuntimeError, match="host ran out of memory"):
        main(args)


def test_layouts_from_a_file_and_the_config(tmp_path, capsys):
    """``--layouts FILE`` and a ``mesh`` section of the ``--config`` file set a layout's mesh:
    ``--mesh`` > ``--layouts`` > ``--config`` > the preset default; bad sections are errors
    naming the file and key (exit 2) before anything runs."""
    import json

    from kdsa.model.config import get_preset

    def plan_mesh(*extra):
        assert main(["plan", "--json", "--batch", "8", "--seq", "64", *extra]) == 0
        return {k: v for k, v in json.loads(capsys.readouterr().out)["mesh"].items() if v > 1}

    layouts = tmp_path / "layouts.json"
    layouts.write_text(json.dumps({"train": {"fsdp": 2, "expert": 2},
                                   "generate": "data=2,tensor=2"}))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(get_preset("tiny").to_hf_config() | {
        "mesh": {"train": "expert=4", "generate": {"data": 4}}}))
    assert plan_mesh("--preset", "tiny", "--layouts", str(layouts)) == {"fsdp": 2, "expert": 2}
    assert plan_mesh("--preset", "tiny", "--layouts", str(layouts), "--layout", "generate") == \
        {"data": 2, "tensor": 2}
    assert plan_mesh("--config", str(cfg)) == {"expert": 4}
    assert plan_mesh("--config", str(cfg), "--layout", "generate") == {"data": 4}
    assert plan_mesh("--config", str(cfg), "--layouts", str(layouts)) == {"fsdp": 2, "expert": 2}
    assert plan_mesh("--config", str(cfg), "--layouts", str(layouts), "--mesh", "tensor=2") == \
        {"tensor": 2}
    for bad, msg in [({"trian": {"fsdp": 2}}, "unknown layout 'trian'"),
                     ({"train": {"fsdp": 2.5}}, "train.fsdp=2.5 is not an integer"),
                     ({"train": {"fsd": 2}}, "unknown mesh axis 'fsd'"),
                     ({"train": {"fsdp": -1, "expert": -1}}, "only one mesh axis may be -1"),
                     ({"generate": [2]}, "generate must be an object of axis sizes"),
                     ([1], "the layouts must be a JSON object")]:
        layouts.write_text(json.dumps(bad))
        assert main(["plan", "--preset", "tiny", "--layouts", str(layouts)]) == 2
        err = capsys.readouterr().err
        assert f"--layouts {layouts}" in err and msg in err, err


@pytest.mark.parametrize("command", ["train", "generate", "serve"])
def test_train_generate_serve_take_the_layouts(command, tmp_path, capsys, monkeypatch):
    """The commands that run a model pass the chosen layout's mesh to ``fit_layout``: the
    ``--config`` file's ``mesh`` section, ``--layouts`` over it, ``--mesh`` over both; a bad
    section is an error naming the file and key (exit 2) before any mesh or model is made.
    ``fit_layout`` is replaced by a recorder that stops the command: nothing compiles."""
    import json

    from kdsa.model import transformer
    from kdsa.sharding import mesh as mesh_lib

    layout = "train" if command == "train" else "generate"
    seen = []

    def record(config, layout_name, *, override=None, **kw):
        if isinstance(override, dict):  # parsed: every axis, 1 where not given
            override = {a: n for a, n in override.items() if n != 1}
        seen.append((layout_name, override))
        raise ValueError("stopped by the test")

    def no_model(*a, **kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(mesh_lib, "fit_layout", record)
    monkeypatch.setattr(transformer.Transformer, "__init__", no_model)
    extra = {"train": ["--run-dir", str(tmp_path / "run"), "--steps", "20"],
             "generate": ["--prompts", str(tmp_path / "in.jsonl"), "--out",
                          str(tmp_path / "out.jsonl")],
             "serve": []}[command]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')  # (checked before the mesh)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(get_preset("tiny").to_hf_config() | {
        "mesh": {"train": {"expert": 2, "sequence": 2}, "generate": {"data": 2, "tensor": 2}}}))
    layouts = tmp_path / "layouts.json"
    layouts.write_text(json.dumps({layout: "fsdp=4"}))

    def mesh_of(*args):
        assert main([command, *args, *extra]) == 2
        assert "stopped by the test" in capsys.readouterr().err
        return seen.pop()

    want = {"train": {"expert": 2, "sequence": 2}, "generate": {"data": 2, "tensor": 2}}[layout]
    assert mesh_of("--config", str(cfg)) == (layout, want)
    assert mesh_of("--config", str(cfg), "--layouts", str(layouts)) == (layout, {"fsdp": 4})
    assert mesh_of("--config", str(cfg), "--layouts", str(layouts), "--mesh", "data=8") == \
        (layout, "data=8")
    if command == "train":  # no override: the preset's default (generate: one device, no mesh)
        assert mesh_of("--preset", "tiny") == ("train", None)
    for bad, msg in [({layout: {"tensr": 2}}, f"{layout}: unknown mesh axis 'tensr'"),
                     ({layout: {"data": "2"}}, f"{layout}.data='2' is not an integer"),
                     ({layout: {"data": -1, "fsdp": -1}},
                      f"{layout}: only one mesh axis may be -1")]:
        cfg.write_text(json.dumps(get_preset("tiny").to_hf_config() | {"mesh": bad}))
        # the bad section fails even where --mesh decides the layout
        assert main([command, "--config", str(cfg), "--mesh", "data=8", *extra]) == 2
        err = capsys.readouterr().err
        assert f"--config {cfg}: mesh: {msg}" in err, err
    assert seen == []


def test_muon_state_and_tpu_cache_rows(tiny_abstract, capsys):
    """``--optimizer muon``: one momentum per matrix element (AdamW's two for the embedding,
    head and vectors), equal to optax's state for the model (the plan counted AdamW's for every
    run); ``--platform tpu`` (the default with ``--compile``): the DSA cache rows padded to 128
    lanes as the engine allocates them there."""
    import jax

    from kdsa.cli.plan_cmd import _moments
    from kdsa.train.config import TrainConfig
    from kdsa.train.optim import make_optimizer

    cfg = TINY.replace(param_dtype="bfloat16")
    sizes = dict(data=1, fsdp=1, expert=1, tensor=1, sequence=1)
    params = nnx.state(abstract_model(cfg), nnx.Param)
    for opt in ("adamw", "muon"):
        state = jax.eval_shape(make_optimizer(TrainConfig(optimizer=opt), params).init,
                               nnx.as_pure(params))
        want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim)
        plan = make_plan(cfg, "train", sizes, device_memory=GiB, batch=1, seq=32,
                         optimizer_moments=_moments(opt))
        # (Muon's state also holds its 3 Newton-Schulz coefficients: 12 bytes)
        assert 0 <= want - plan.memory["optimizer"] <= 12, opt
    gen = dict(device_memory=GiB, batch=2, seq=256, model=tiny_abstract)
    plain = make_plan(TINY, "generate", sizes, **gen)
    tpu = make_plan(TINY, "generate", sizes, rope_lanes=128, **gen)
    n_dsa = TINY.mixer_kinds.count("dsa")
    grow = 2 * 256 * n_dsa * (dsa_cache_bytes_per_token(TINY, 128) - dsa_cache_bytes_per_token(TINY))
    assert tpu.memory["caches"] - plain.memory["caches"] == grow > 0
