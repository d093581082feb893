"""The Pallas kernels through the real XLA:TPU and Mosaic compilers, for abstract TPU devices
(``jax.experimental.topologies``; ``libtpu`` from the test extra, no TPU needed). Small shapes;
``bench/aot.py`` compiles K3's. Skipped only where libtpu cannot be imported."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

libtpu = pytest.importorskip("libtpu", reason="libtpu (the XLA:TPU compiler) is not installed")

from kdsa.kernels_pallas import common  # noqa: E402
from kdsa.kernels_pallas.mxfp4_matmul import mxfp4_grouped_matmul, mxfp4_matmul  # noqa: E402
from kdsa.kernels_pallas.paged_index import paged_index_scores  # noqa: E402
from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention  # noqa: E402
from kdsa.sharding.aot import unfused_instructions  # noqa: E402

CHIPS = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")


def compile_for(topology: str, fn, *shapes):
    """``fn`` compiled for one abstract device of ``topology`` with the kernels' TPU tiles."""
    from kdsa.train.aot import topology_devices

    sharding = jax.sharding.make_single_device_sharding(topology_devices(topology)[0])
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    with common.compile_target("tpu"):
        return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("topology", CHIPS)
def test_mxfp4_matmul_dense_and_grouped_compile(topology):
    """Decode shape (M 16) of the dense kernel, and the grouped (MoE, scalar-prefetch) kernel:
    both pass Mosaic; VMEM stays within the default scoped limit (no temp beyond the
    per-call weight re-layout)."""
    m, k, n, e = 16, 1024, 512, 4
    dense = compile_for(topology, mxfp4_matmul, ((m, k), jnp.bfloat16),
                        ((n, k // 32, 16), jnp.uint8), ((n, k // 32), jnp.uint8))
    assert "tpu_custom_call" in dense.as_text()
    grouped = compile_for(topology, mxfp4_grouped_matmul, ((64, k), jnp.bfloat16),
                          ((e, n, k // 32, 16), jnp.uint8), ((e, n, k // 32), jnp.uint8),
                          ((e,), jnp.int32))
    assert "tpu_custom_call" in grouped.as_text()
    assert dense.memory_analysis() is not None


@pytest.mark.parametrize("topology", CHIPS)
def test_sparse_mla_mosaic_forward_and_backward_compile(topology):
    """The Mosaic sparse MLA kernel, forward and backward, bf16 at K3 widths (latent 512 + RoPE
    key 64): both pass Mosaic, and the latent cache reaches the kernel as it is, in HBM (no copy
    or re-layout of it: rows are gathered by DMA as uint32 row pairs). The 64-wide RoPE part is
    copied: XLA stores a ``[B, S, 64]`` bf16 array S-minor, and the kernel needs it row-major
    (docs/kernels.md, "TPU compile")."""
    b, t, h, s, dc, dr, k = 1, 8, 16, 1024, 512, 64, 128
    shapes = (((b, t, h, dc + dr), jnp.bfloat16), ((b, s, dc), jnp.bfloat16),
              ((b, s, dr), jnp.bfloat16), ((b, t, k), jnp.int32))
    fwd = lambda q, a, r, i: sparse_mla_attention(q, (a, r), i, 0.1, dc)  # noqa: E731

    def grad(q, a, r, i):
        return jax.grad(lambda *x: fwd(*x, i)[0].sum(), argnums=(0, 1, 2))(q, a, r)

    text = compile_for(topology, fwd, *shapes).as_text()
    assert text.count("sparse_mla_fwd_tpu") and '"input_memory_space_colors"' in text
    latent = f"bf16[{b},{s},{dc}]"
    copies = [ln for ln in text.splitlines() if latent in ln.split("=", 1)[-1][:40]
              and "parameter(" not in ln]
    assert not copies, copies                                  # the latent cache is not copied
    assert "sparse_mla_bwd_tpu" in compile_for(topology, grad, *shapes).as_text()


@pytest.mark.parametrize("topology", CHIPS)
def test_paged_index_mosaic_kernel_compiles_and_reads_the_pool_in_place(topology):
    """The paged lightning-indexer kernel at K3's widths (64 index heads of 128, bfloat16 keys),
    a decode step of 8 rows over 256 pages each of a 1,024-page pool: it passes Mosaic, and the
    pool reaches it as it is, in HBM (no copy or re-layout: pages are fetched by DMA through the
    block table)."""
    b, j, d, pages, width = 8, 64, 128, 1024, 256
    rows = (pages + 1) * 64  # as a paged cache pool: its pages and the scratch page
    shapes = (((b, 1, j, d), jnp.bfloat16), ((b, 1, j), jnp.float32),
              ((rows, d), jnp.bfloat16), ((b, width), jnp.int32))
    compiled = compile_for(topology, lambda q, w, pool, table: paged_index_scores(
        q, w, pool, table, 64), *shapes)
    text = compiled.as_text()
    assert "paged_index_scores_tpu" in text and '"input_memory_space_colors"' in text
    pool = f"bf16[{rows},{d}]"
    copies = [ln for ln in text.splitlines() if pool in ln.split("=", 1)[-1][:40]
              and "parameter(" not in ln]
    assert not copies, copies


def test_plan_compile_tiny_train_step_for_v5e(capsys):
    """``kdsa plan --compile --topology v5e:2x2``: the real train step of a 1-layer tiny model
    (Gated DSA with its indexer and the Pallas attention kernel, MoE) compiled with XLA:TPU on
    ``fsdp=2,expert=2``; XLA's memory beside
    the estimate, and a refusal (exit 3) when the compiled peak exceeds --device-memory although
    the estimate fits. Stated factors at this size: the compiled arguments (state + batch) are
    1-4x the estimated parameters + optimizer state (TPU tiles pad 16-wide dims to 128 lanes),
    and the peak stays under 40x the estimate (temporaries and code dominate a 0.1M-parameter
    model; K3-sized comparisons: docs/sharding.md)."""
    import json

    from kdsa.cli.main import main

    rc = main(["plan", "--preset", "tiny", "--set", "num_hidden_layers=1",
               "--set", "linear_attn_config.kda_layers=[]",
               "--set", "linear_attn_config.full_attn_layers=[1]",
               "--set", "first_k_dense_replace=0", "--set", "attention_impl=pallas",
               "--mesh", "fsdp=2,expert=2", "--batch", "4", "--seq", "64", "--compile",
               "--topology", "v5e:2x2", "--device-memory", "10MiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    c, plan = out["compiled"]["train step"], out
    assert rc == 3 and plan["fits"] and not c["fits"]  # the estimate fits, the program not
    assert c["device_memory"] == 10 << 20 and c["peak"] > 10 << 20
    state = plan["memory"]["parameters"] + plan["memory"]["optimizer"]
    assert 1.0 <= c["arguments"] / state <= 4.0, (c, plan["memory"])
    assert c["peak"] < 40 * plan["total"], (c, plan["total"])
    assert c["compile_seconds"] > 0 and c["temporaries"] > 0
    assert c["aliased"] >= 0.9 * state  # the state is donated: the new one reuses its buffers
    # the MoE's expert-parallel exchange inside the whole step is XLA:TPU's ragged all-to-all,
    # not the CPU's padded one: rows, expert ids and the way back forward, the two float
    # exchanges again backward
    assert c["collectives"].get("ragged-all-to-all", 0) == 5, c["collectives"]
    # with attention_impl=pallas the Mosaic sparse MLA kernel is inside the sharded step (in a
    # shard_map over batch and heads; without it XLA:TPU refuses: "Mosaic kernels cannot be
    # automatically partitioned"): its forward, and the two kernels of its backward
    assert c["kernels"] == {"sparse_mla_fwd_tpu": 1, "sparse_mla_bwd_tpu": 2}, c["kernels"]


def test_plan_compile_tiny_generate_steps_for_v5e(capsys):
    """``kdsa plan --compile --layout generate``: the engine's prefill chunk and decode step
    (``infer/aot.py``: the runner's own step functions) of a 1-layer tiny model compiled with
    XLA:TPU on ``expert=2,tensor=2``, the MoE's exchange a ragged all-to-all in both. Stated factors at this size: each step's arguments (weights
    + cache + inputs) are 1-4x the estimated parameters + caches, and its peak stays under 40x
    the estimate (code and temporaries dominate a 0.2M-parameter model)."""
    import json

    from kdsa.cli.main import main

    rc = main(["plan", "--preset", "tiny", "--set", "num_hidden_layers=1",
               "--set", "linear_attn_config.kda_layers=[]",
               "--set", "linear_attn_config.full_attn_layers=[1]",
               "--set", "first_k_dense_replace=0", "--layout", "generate",
               "--mesh", "expert=2,tensor=2", "--batch", "4", "--seq", "256",
               "--prefill-chunk", "64", "--compile", "--topology", "v5e:2x2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(out["compiled"]) == {"prefill", "decode"}
    held = out["memory"]["parameters"] + out["memory"]["caches"]
    for step, c in out["compiled"].items():
        assert c["fits"] and c["compile_seconds"] > 0, (step, c)
        assert 1.0 <= c["arguments"] / held <= 4.0, (step, c, out["memory"])
        assert c["peak"] < 40 * out["total"], (step, c, out["total"])
        assert c["aliased"] > 0  # the cache is donated, as the runner does
        assert c["collectives"].get("ragged-all-to-all", 0) == 3, (step, c["collectives"])


def test_plan_compile_generate_steps_with_the_pallas_kernels(capsys):
    """``--set attention_impl=pallas``: the Mosaic sparse MLA kernel inside the prefill and
    decode steps on ``expert=2,tensor=2`` (the cache path runs it in a ``shard_map`` too; the
    train step with the kernel is the test above). With MXFP4 experts and ``moe_impl=pallas``
    the grouped MXFP4 kernel runs inside the expert exchange's ``shard_map`` on each device's
    own experts' bytes, ``check_vma`` on (before, the layer's experts were dequantised first
    and the kernel not used under expert parallelism); I = 64, so over ``tensor=2`` w2's
    bytes split at whole blocks of 32."""
    import json

    from kdsa.cli.main import main

    rc = main(["plan", "--preset", "tiny", "--set", "num_hidden_layers=1",
               "--set", "linear_attn_config.kda_layers=[]",
               "--set", "linear_attn_config.full_attn_layers=[1]",
               "--set", "first_k_dense_replace=0", "--set", "attention_impl=pallas",
               "--set", "moe_impl=pallas", "--set", "expert_weight_format=mxfp4",
               "--set", "moe_intermediate_size=64",
               "--layout", "generate", "--mesh", "expert=2,tensor=2", "--batch", "4",
               "--seq", "256", "--prefill-chunk", "64", "--compile", "--topology", "v5e:2x2",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    kernels = {"sparse_mla_fwd_tpu": 1, "mxfp4_grouped_matmul": 3}
    assert {step: c["kernels"] for step, c in out["compiled"].items()} == {
        "prefill": kernels, "decode": kernels}
    assert all(c["collectives"].get("ragged-all-to-all") == 3 for c in out["compiled"].values())


def test_paged_generate_steps_compile_with_the_pool_in_place(monkeypatch):
    """The paged cache on a mesh (``model/paged_attention.py``): the prefill and decode steps on
    ``data=2,tensor=2`` (two batch device groups, each with its partition of the pool) compile
    for v5e with XLA attention and with the Pallas kernels inside (sparse MLA; the paged index
    scores in the decode step), and no collective moves the pool (no collective has the pool's
    rows, whole or one partition, in its shape), nor is it padded. Two Gated DSA + MoE layers
    share one scan: neither slices its own pool out of the stack (no array has one layer's
    rows), nor its routed experts' weights (``model/stacked_experts.py``). The pools are
    arguments in row-major layout (``infer/cache_layout.py : cache_shardings``), so no step copies a
    whole stack of them (XLA:TPU's default layout for these narrow buffers, rows minor, made
    it copy each to row-major and back at every step). The dense-slot cache's decode step
    reads its stacks in place too (``sequence_parallel._in_stack``): no layer's ``[slots,
    L, D]`` slice, no copy of a stack."""
    import re

    from kdsa.infer import aot
    from kdsa.model.config import get_preset
    from kdsa.model.overrides import apply_overrides
    from kdsa.model.paged_cache import SCRATCH_ROWS

    monkeypatch.setattr(aot, "compiled_memory", lambda compiled, seconds: compiled.as_text())
    sizes = {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2, "sequence": 1}
    # 4 slots x 4 pages in 2 partitions, with their scratch rows (a page's worth) each
    part = 4 * 4 // 2 * 64 + SCRATCH_ROWS
    steps = {}
    for impl in ("xla", "pallas"):
        cfg = apply_overrides(get_preset("tiny"), [
            "num_hidden_layers=2", "linear_attn_config.kda_layers=[]",
            "linear_attn_config.full_attn_layers=[1, 2]", "first_k_dense_replace=0",
            "compute_dtype=bfloat16", "param_dtype=bfloat16", f"attention_impl={impl}"])
        steps.update({(impl, name): f for name, f in aot.generate_step_compiles(
            cfg, "v5e:2x2", sizes, slots=4, max_len=256, prefill_chunk=64, paged=True).items()})
        dense = aot.generate_step_compiles(cfg, "v5e:2x2", sizes, slots=4, max_len=256,
                                           prefill_chunk=64)["decode"]
        # the dense-slot stacks [2 layers, 2 slots per device, 256, D]: no layer's slice or
        # copy materialized (a slice fused into the indexer's product is no copy)
        stacks = [ln for ln in unfused_instructions(dense()) if re.search(
            r"= \w+\[(2,)?(1,)?2,256,\d+\]\S* (copy|copy-start|fusion|dynamic-slice)\(", ln)
            and "scatter" not in ln.split("=")[0]]  # (the writes update a stack in place)
        assert not stacks, (impl, stacks[:2])
    for name, compile_step in steps.items():
        text = compile_step()
        # no copy of a stack's pools [2, R, D] (a relayout)
        copies = [ln for ln in text.splitlines()
                  if re.search(rf"= \w+\[2,{part},\d+\]\S* copy(-start)?\(", ln)]
        assert not copies, (name, copies[:2])
        assert ("sparse_mla_fwd_tpu" in text) == (name[0] == "pallas"), name
        # a decode step's index scores read the pool's pages by DMA (kernels_pallas/paged_index)
        assert ("paged_index_scores_tpu" in text) == (name == ("pallas", "decode")), name
        ops = [m.group(1) for m in re.finditer(
            r"= (.*?) (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
            r"(?:-start)?\(", text)]  # the result shapes of every collective
        assert ops, name
        moved = [o for o in ops if re.search(rf"[\[,]({part}|{2 * part})[\],]", o)]
        assert not moved, (name, moved)
        # nor is a partition padded (bfloat16 pools: the sparse MLA kernel reads rows as 32-bit
        # pairs, and an odd row count made it pad, i.e. copy, the whole pool at every step)
        whole = [ln for ln in text.splitlines() if re.search(
            rf"= \w+\[(\d+,)?({part}|{part + 1}),\d+\]\S* pad\(", ln)]
        assert not whole, (name, whole[:2])
        # the layers read and write their stack's [2, R, D] pools in place: slicing a layer's
        # own [R, D] out (a dynamic-slice, then a copy) cost a pool's copy per layer and step
        sliced = [ln for ln in text.splitlines() if re.search(rf"= \w+\[(1,)?{part},\d+\]", ln)]
        assert not sliced, (name, sliced[:2])
        # nor are a layer's routed experts [E, De, I / tensor] (or [E, I / tensor, De]) sliced
        # out of their [2, E, ...] stacks: the grouped matmuls read the stacks whole
        e, de, i = cfg.num_experts, cfg.expert_hidden_size, cfg.moe_intermediate_size // 2
        experts = [ln for ln in text.splitlines()
                   if re.search(rf"= \w+\[(1,)?{e},({de},{i}|{i},{de})\]", ln)]
        assert not experts, (name, experts[:2])


def test_decode_step_keeps_the_kda_states_split_over_heads(monkeypatch):
    """The runner places a KDA layer's recurrent state ``[repeats, slots, H, K, V]`` and conv
    window ``[repeats, slots, W-1, 3, H*K]`` with their heads over ``tensor``, as the step
    computes them (``infer/cache_layout.py : cache_shardings``): the compiled decode step on
    ``expert=2,tensor=2`` gathers no KDA state. With the heads replicated the step all-gathered
    every state it wrote (28 ``f32[2, 2, 16, 16]`` all-gathers in this 2-layer tiny step), and
    with q|k|v concatenated in one channel axis ``[.., W-1, 3*H*K]`` its conv window too."""
    import re

    from kdsa.infer import aot
    from kdsa.model.config import get_preset
    from kdsa.model.overrides import apply_overrides

    monkeypatch.setattr(aot, "compiled_memory", lambda compiled, seconds: compiled.as_text())
    cfg = apply_overrides(get_preset("tiny"), [
        "num_hidden_layers=2", "linear_attn_config.kda_layers=[1]",
        "linear_attn_config.full_attn_layers=[2]", "first_k_dense_replace=0"])
    lac = cfg.linear_attn_config
    sizes = {"data": 1, "fsdp": 1, "expert": 2, "tensor": 2, "sequence": 1}
    text = aot.generate_step_compiles(cfg, "v5e:2x2", sizes, slots=4, max_len=256,
                                      prefill_chunk=64)["decode"]()
    gathers = [ln for ln in text.splitlines() if re.search(r" all-gather(-start)?\(", ln)]
    h, k, w = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    state = rf"f32\[(1,)?2,{h},{k},{k}\]"
    conv = rf"f32\[(1,)?2,{w - 1},(3,{h * k}|{3 * h * k})\]"
    assert gathers                      # the pattern finds the step's other all-gathers
    assert not [ln for ln in gathers if re.search(state, ln)], gathers[:2]
    assert not [ln for ln in gathers if re.search(conv, ln)], gathers[:2]


def test_one_tpu_device_without_a_mesh_reads_its_caches_in_place(monkeypatch):
    """One TPU device without a mesh (``kdsa serve`` on a single chip): the runner places its
    cache on that device with the DSA buffers row-major (``infer/cache_layout.py``) and marks
    the dense-slot stacks so (``DSACache.rows_major``). The generate steps of two Gated DSA
    layers in one scan, paged and dense-slot, then copy no stack or pool and slice no layer's
    own rows out of them. With XLA:TPU's default layout for these narrow buffers (rows minor)
    the paged decode step copied each pool to row-major and back (four whole-pool copies per
    step here), and the dense-slot decode step sliced each layer's ``[slots, L, D]`` out."""
    import re

    from kdsa.infer import aot
    from kdsa.model.config import get_preset
    from kdsa.model.overrides import apply_overrides
    from kdsa.model.paged_cache import SCRATCH_ROWS

    monkeypatch.setattr(aot, "compiled_memory", lambda compiled, seconds: compiled.as_text())
    cfg = apply_overrides(get_preset("tiny"), [
        "num_hidden_layers=2", "linear_attn_config.kda_layers=[]",
        "linear_attn_config.full_attn_layers=[1, 2]", "first_k_dense_replace=0",
        "compute_dtype=bfloat16", "param_dtype=bfloat16"])
    part = 4 * 4 * 64 + SCRATCH_ROWS  # 4 slots x 4 pages, one partition, its scratch page
    for paged, rows in ((True, rf"{part}"), (False, r"4,256")):
        for name, compile_step in aot.generate_step_compiles(
                cfg, "v5e:1x1", None, slots=4, max_len=256, prefill_chunk=64,
                paged=paged).items():
            text = compile_step()
            copies = [ln for ln in text.splitlines()
                      if re.search(rf"= \w+\[2,{rows},\d+\]\S* copy(-start)?\(", ln)]
            assert not copies, (paged, name, copies[:2])
            # a layer's own rows as a buffer of their own (a slice, then read): outside fusions
            sliced = [ln for ln in unfused_instructions(text) if re.search(
                rf"= \w+\[(1,)?{rows},\d+\]\S* (copy|fusion|dynamic-slice)\(", ln)]
            assert not sliced, (paged, name, sliced[:2])


def test_mxfp4_expert_kernel_compiles_on_a_data_mesh(capsys):
    """The MXFP4 grouped-matmul kernel (``moe_impl=pallas``) on a mesh without expert
    parallelism runs in a ``shard_map`` over each device's tokens: XLA:TPU compiled neither
    generate step before ("Mosaic kernels cannot be automatically partitioned"). Under expert
    parallelism: ``test_plan_compile_generate_steps_with_the_pallas_kernels``."""
    import json

    from kdsa.cli.main import main

    rc = main(["plan", "--preset", "tiny", "--set", "num_hidden_layers=1",
               "--set", "linear_attn_config.kda_layers=[]",
               "--set", "linear_attn_config.full_attn_layers=[1]",
               "--set", "first_k_dense_replace=0", "--set", "moe_impl=pallas",
               "--set", "expert_weight_format=mxfp4", "--layout", "generate",
               "--mesh", "data=4", "--batch", "4", "--seq", "256", "--prefill-chunk", "64",
               "--compile", "--topology", "v5e:2x2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {step: c["kernels"] for step, c in out["compiled"].items()} == {
        "prefill": {"mxfp4_grouped_matmul": 3}, "decode": {"mxfp4_grouped_matmul": 3}}


def test_k3_generate_mesh_keeps_each_tensor_group_on_one_ring():
    """K3's generate layout (``expert=32,tensor=8,data=-1``) on ``v5p:8x8x16``: JAX's torus-aware
    arrangement refuses the shape unless it may split a physical axis; with that allowed each
    tensor group is 8 chips along one axis (a ring). It fell back to the device list in order,
    which scattered the groups over the torus (slower collectives; ``kdsa plan --compile``
    measured that order too)."""
    import numpy as np

    from kdsa.sharding.mesh import AXES, device_array, layout_sizes
    from kdsa.train.aot import topology_devices

    arr = device_array(layout_sizes("k3-2.8t", "generate"), topology_devices("v5p:8x8x16"))
    groups = np.moveaxis(arr, AXES.index("tensor"), -1).reshape(-1, 8)
    for group in groups[::97]:
        coords = np.array([d.coords for d in group])  # [8, 3]
        moving = [a for a in range(3) if len(set(coords[:, a])) > 1]
        assert len(moving) == 1 and sorted(coords[:, moving[0]]) == list(range(
            min(coords[:, moving[0]]), min(coords[:, moving[0]]) + 8)), coords
