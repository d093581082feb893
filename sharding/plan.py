"""Per-device memory and per-step communication of a layout on a pod we cannot run here.

Parameters come from the abstract model (``kdsa.model.count.abstract_model``, no memory) and
each one's per-device shard from the layout's rules (``rules.logical_to_spec`` on an
``AbstractMesh`` of the requested sizes), so the plan reads the same table the real run uses.

Memory terms (bytes on the busiest device):

* ``parameters``: every variable's shard, stored dtype.
* ``gradients`` (train): trainable (``nnx.Param``) shards in the parameter dtype.
* ``optimizer`` (train): AdamW's two moments per trainable element in the parameter dtype
  (optax's default; the trainer keeps no separate master copy: set ``param_dtype=float32`` for
  float32 master weights and moments); with Muon (``optimizer_moments``, ``kdsa plan
  --optimizer muon``) one momentum per matrix element and AdamW's two for the rest.
* ``accumulator`` (train, ``accum_steps > 1``): the gradient sum carried across micro-batches
  (``train/step.py``), a second gradient-sized buffer beside each micro-batch's gradients. Until 2026-12-04 this term counted 12 bytes per bfloat16
  parameter (float32 moments and master); the XLA:TPU compile of a K3 slice showed 4 (its
  arguments are exactly 3x the bfloat16 parameters; docs/sharding.md section 9).
* ``gathered`` (train): weights sharded over ``fsdp`` (and, in the train layout, non-expert
  weights over ``expert``, ZeRO-3 style) are all-gathered whole for their matmuls; the term is
  the largest gathering unit. An unscanned weight (the vocabulary projections) is held whole
  three times: gathered for the forward, gathered (and laid out) for the backward, and its
  unsharded local gradient before the reduce-scatter; XLA:TPU's memory-usage report of a K3
  slice (``expert=64``) shows three 2.19 GiB ``bf16[7168, 163840]`` buffers
  (docs/sharding.md section 9). A layer repeat inside the scan counts twice (its weights,
  gathered again for the remat backward, beside their unsharded gradients): with
  ``expert=16,fsdp=4`` the same slice's report holds each of a MoE layer's gathered
  ``bf16[56, 3584, 3072]`` expert matrices about twice, and its temporaries grew by 2.69 GiB
  over ``expert=64`` where this term grew by 2.68.
* ``activations`` (train): ``B_l = batch / accum_steps / |act_batch|`` rows (one
  micro-batch) of ``T_l = seq / |act_seq|`` tokens per device. With remat
  (``full``/``nothing_saveable``) each scanned layer group keeps its input carry,
  ``(1 + NB) * B_l * T_l * D`` (residual + AttnRes blocks), and one group is recomputed at a
  time (2x its activations: values and their gradients). Without remat
  (``none``/``dots_saveable``) every layer's activations stay. A layer's activations per token
  are the tensors listed in :func:`layer_activation_elements` (heads and FFN hidden divided by
  the tensor axes), in the compute dtype.
* ``logits`` (train): ``B_l * T_l * V / |vocab|`` float32, twice (logits and their gradient).
* ``moe_dispatch`` (train): the expert-parallel receive buffers of one MoE layer, forward and
  backward: ``2 * R * (2 De + 3 I / |expert_mlp|)`` in the compute dtype (rows in, gate, up,
  hidden, rows out), ``R`` rows per device. ``M = B_l T_l k`` assignments leave each device;
  dropless (no ``moe_capacity_factor``) sizes the buffers for the worst case, every device's
  assignments on one owner: ``R = ep * M``; with a factor ``cf``, ``R = cf * M``
  (``model/expert_parallel.py``). Measured against XLA:TPU (a 4-layer K3 slice on v5p 8x8x16,
  ``expert=64,fsdp=16``, 1024 x 1024 tokens): dropless 89.9 GiB of temporaries, with a factor
  of 1.25 19.7 GiB; this term predicts 62.8 of the 70.1 GiB difference (docs/sharding.md).
* ``caches`` (generate): ``batch`` sequences over ``act_batch``, ``seq`` tokens each: DSA
  latent + RoPE key + indexer key per token per DSA layer (not head-sharded: one latent per
  token; with ``rope_lanes``, TPU's 128, each buffer's width as the engine pads it there), KDA
  state per sequence per KDA layer (heads over ``tensor``).
* ``prefill`` (generate): one layer's activations for ``prefill_chunk`` tokens (the chunk a
  prefill step processes on a device, all its requests together), plus the request's cache row
  twice (read out of its slot, and the updated row written back). Measured against XLA:TPU
  (K3 on v5p 4x8x8, ``expert=32,tensor=8``, 64 x 128K slots, chunk 4096): 8.03 GiB of
  temporaries against a term of 9.42 GiB, of which the row is 4.19 GiB (twice: 8.38).

Communication per step, bytes sent per device on each mesh axis of size n (ring estimates;
``passes`` = 3 with remat (forward, recompute, backward), else 2):

* ``fsdp`` / ``expert``: each parameter sharded over ``fsdp`` (and, for the train layout's
  non-expert weights, over ``expert`` too) is all-gathered for the forward and again for
  remat/backward and its gradient reduce-scattered: ``3 (F-1)/F * S`` in all (F = the product
  of those axes' sizes, S = the whole weight's bytes), as a gather over ``fsdp`` (to ``S /
  f_e`` per device) and then over ``expert``: ``3 (f_f-1)/F * S`` under ``fsdp``, ``3
  (f_e-1)/f_e * S`` under ``expert`` (until 2026-12-07 all of it was reported under ``fsdp``,
  and before that the ``expert`` part was left out).
* ``data`` / ``fsdp`` / ``expert`` / ``sequence``, gradient all-reduce over every batch-like
  axis that does not shard the parameter: ``2 (n-1)/n * g`` (g = local gradient bytes).
* ``expert``: token all-to-all per MoE layer, dispatch + combine per pass:
  ``2 * passes * (n-1)/n * B_l T_l k De`` (x capacity factor when set). Generate, per MoE
  layer and decode step: ``2 (n-1)/n * B_l k De`` when requests are split over ``expert``
  (all-to-all), else the replicated-token psum ``2 (n-1)/n * B_l De``.
* ``tensor``: two all-reduces of ``B_l T_l D`` per layer per pass (row-parallel outputs).
* ``sequence``: per KDA layer the all-gather of ``(M, B)`` maps, ``(n-1) B_l H_l K (K+V) 4``;
  per DSA layer the key gather, ``(n-1)/n * B_l T (kv_lora + rope + Di)``; per pass.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from kdsa.model.config import ModelConfig
from kdsa.model.dsa_cache import dsa_cache_bytes_per_token
from kdsa.model.kda_layer import kda_cache_bytes_per_sequence
from kdsa.model.layers import dtype_of
from kdsa.sharding.mesh import AXES, check_layout
from kdsa.sharding.rules import get_rules, logical_to_spec, variable_axes

GiB = 2 ** 30
UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
         "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``"141GiB"``, ``"80GB"``, ``"96 gib"``, ``"1e9"`` -> bytes."""
    t = text.strip().lower().replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            num = t[:-len(unit)]
            break
    else:
        unit, num = "b", t
    try:
        value = float(num) * UNITS[unit]
    except ValueError:
        raise ValueError(f"cannot read a byte size from {text!r} (e.g. 141GiB, 80GB)") from None
    if value <= 0:
        raise ValueError(f"a byte size must be positive, got {text!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: str
    mesh: dict[str, int]
    devices: int
    batch: int
    seq: int
    device_memory: int
    memory: dict[str, int]  # term -> bytes per device
    communication: dict[str, int]  # mesh axis -> bytes sent per device per step
    notes: tuple[str, ...]
    accum_steps: int = 1  # train: micro-batches per step (activations are one micro-batch's)

    @property
    def total(self) -> int:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def refusal(self) -> str | None:
        """None if it fits, else which terms make it too large."""
        if self.fits:
            return None
        name, big = max(self.memory.items(), key=lambda kv: kv[1])
        return (f"layout {self.layout!r} on {self.devices} devices does not fit: "
                f"{_gib(self.total)} per device > device memory {_gib(self.device_memory)}; "
                f"largest term: {name} = {_gib(big)}"
                + ("" if big <= self.device_memory else " (alone exceeds the device)"))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total=self.total, fits=self.fits)
        return d


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _shard_elements(shape, spec, sizes) -> int:
    n = 1
    for dim, entry in zip(shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-dim // math.prod(sizes[a] for a in axes))
    return n


def _gather_factors(logical, spec, sizes) -> dict[str, int]:
    """How many times larger a weight is once gathered for its matmul, per axis: the ``fsdp``
    and ``expert`` sizes sharding it, except ``expert`` on its ``experts`` dimension
    (expert-parallel weights stay where they are)."""
    f = {"fsdp": 1, "expert": 1}
    for name, entry in zip(logical, spec):
        for a in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            if a == "fsdp" or (a == "expert" and name != "experts"):
                f[a] *= sizes[a]
    return f


def _axes_of(spec) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        out.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return out


def _prod(sizes, rules, logical) -> int:
    return math.prod(sizes[a] for a in (rules.get(logical) or ()) if sizes.get(a, 1) > 1)


def layer_activation_elements(c: ModelConfig, mixer: str, ffn: str, tp: int) -> int:
    """Activation elements per token of one layer (the tensors a backward pass needs).

    KDA: q, k, v, g, output gate, pre- and post-conv q|k|v, output (12 H K), beta (H).
    DSA (sparse): queries (N (nope + rope)), absorbed queries (N (kv_lora + rope)), latent
    outputs (N kv_lora), outputs and gate (2 N v), indexer q, k, weights (J Di + Di + J),
    latent KV (kv_lora + rope), q latent (q_lora). MoE: router scores (E), latent z (De), per
    selected expert gate/up/act (3 I) and output (De), combined output; shared experts 3 I_s.
    Dense FFN: 3 I. Plus the norms and residual adds (4 D). Head and hidden terms / ``tp``.
    """
    d = c.hidden_size
    if mixer == "kda":
        h, k = c.linear_attn_config.num_heads, c.linear_attn_config.head_dim
        mix = (12 * h * k + h) / tp
    else:
        n, r, v = c.num_attention_heads, c.qk_rope_head_dim, c.v_head_dim
        heads = n * (c.qk_nope_head_dim + r) + n * (c.kv_lora_rank + r) + n * c.kv_lora_rank \
            + 2 * n * v
        idx = (c.index_n_heads * c.index_head_dim + c.index_head_dim + c.index_n_heads
               if c.use_indexer else 0)
        mix = (heads + idx) / tp + c.kv_lora_rank + r + (c.q_lora_rank or 0)
    if ffn == "moe":
        de, i = c.expert_hidden_size, c.moe_intermediate_size
        f = c.num_experts + de + c.num_experts_per_token * (3 * i / tp + de) + de \
            + 3 * i * c.num_shared_experts / tp
    else:
        f = 3 * c.intermediate_size / tp
    return int(mix + f + 4 * d)


def make_plan(config: ModelConfig, layout: str, sizes: dict[str, int], *, device_memory: int,
              batch: int, seq: int, prefill_chunk: int = 4096,
              moe_capacity_factor: float | None = None, accum_steps: int = 1,
              model=None, optimizer_moments=None, rope_lanes: int | None = None) -> Plan:
    """The plan for ``config`` under ``layout`` on a mesh of resolved ``sizes`` (no ``-1``).

    ``accum_steps`` (train): micro-batches per step; the activation terms are one micro-batch's
    (``batch / accum_steps`` sequences), as the train step runs them, and the communication all
    of theirs (each pass gathers the weights and reduces its gradients). Raises ``ValueError``
    (from ``mesh.check_layout``) when an axis product does not divide a model, micro-batch or
    sequence dimension. ``model``: a prebuilt abstract model (tests reuse it).
    ``optimizer_moments(path, var)``: optimizer state elements per trainable element (default
    2, AdamW; ``cli/plan_cmd.py`` passes Muon's rule). ``rope_lanes``: the DSA cache rows as
    the engine lays them out on TPU (``infer/cache_layout.py``).
    """
    if any(sizes.get(a, 1) < 1 for a in AXES):
        raise ValueError(f"plan needs explicit axis sizes (no -1), got {sizes}")
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    if batch < 1 or seq < 1:
        raise ValueError(f"--batch and --seq must be >= 1, got {batch}, {seq}")
    if accum_steps < 1 or batch % accum_steps:
        raise ValueError(f"--accum-steps {accum_steps} must be >= 1 and divide --batch {batch}")
    if accum_steps > 1 and layout != "train":
        raise ValueError("--accum-steps is the train layout's (micro-batches of a train step)")
    global_batch, batch = batch, batch // accum_steps  # a pass holds one micro-batch
    check_layout(config, sizes, layout, batch=batch, seq=seq)
    rules = get_rules(layout)
    mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES)
    if model is None:
        from kdsa.model.count import abstract_model
        model = abstract_model(config)
    train = layout == "train"
    cb = jnp.dtype(dtype_of(config.compute_dtype)).itemsize
    mem = dict.fromkeys(("parameters", "gradients", "accumulator", "optimizer", "gathered",
                         "activations", "logits", "moe_dispatch", "caches", "prefill"), 0)
    gathered_units: dict = {}  # unit -> gathered bytes of its weights (one layer repeat)
    comm = dict.fromkeys(AXES, 0.0)
    passes = 3 if config.remat_policy in ("full", "nothing_saveable") else 2
    batch_like = ("data", "fsdp", "expert", "sequence")
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        logical = variable_axes(var)
        spec = logical_to_spec(logical, tuple(var.shape), mesh, rules)
        elems = _shard_elements(var.shape, spec, sizes)
        itemsize = var.dtype.itemsize
        mem["parameters"] += elems * itemsize
        if not train or not isinstance(var, nnx.Param):
            continue
        mem["gradients"] += elems * itemsize
        moments = 2 if optimizer_moments is None else optimizer_moments(path, var)
        mem["optimizer"] += elems * moments * itemsize  # in the parameter dtype
        by_axis = _gather_factors(logical, spec, sizes)
        factor = by_axis["fsdp"] * by_axis["expert"]
        if factor > 1:  # a layer repeat's weights are gathered together; others one by one
            stacked = bool(logical) and logical[0] == "layers"
            unit = tuple(path[:2]) if stacked else tuple(path)
            per_unit = elems * factor * itemsize // (var.shape[0] if stacked else 1)
            copies = 2 if stacked else 3
            gathered_units[unit] = gathered_units.get(unit, 0) + copies * per_unit
        used = _axes_of(spec)
        if factor > 1:  # gathered over every fsdp / expert axis sharding it (the non-expert
            # weights over fsdp x expert in train): forward, backward, gradient reduce-scatter.
            # As a gather over fsdp (to 1/fe of it), then over expert: (F-1)/F of the whole
            full, fe = elems * factor * itemsize, by_axis["expert"]
            comm["expert"] += 3 * (fe - 1) / fe * full
            comm["fsdp"] += 3 * (by_axis["fsdp"] - 1) / factor * full
        for a in batch_like:
            n = sizes[a]
            if n > 1 and a not in used:
                comm[a] += 2 * (n - 1) / n * elems * itemsize
    if gathered_units:
        mem["gathered"] = max(gathered_units.values())
    if train and accum_steps > 1:  # the micro-batches' gradient sum beside each one's
        mem["accumulator"] = mem["gradients"]
    b_l = batch // _prod(sizes, rules, "act_batch")
    t_l = seq // _prod(sizes, rules, "act_seq")
    tp = _prod(sizes, rules, "act_heads")
    kinds = list(zip(config.mixer_kinds, config.ffn_kinds))
    per_layer = [layer_activation_elements(config, m, f, tp) for m, f in kinds]
    n_moe = sum(f == "moe" for _, f in kinds)
    n_kda = sum(m == "kda" for m, _ in kinds)
    n_dsa = len(kinds) - n_kda
    d, de, k = config.hidden_size, config.expert_hidden_size, config.num_experts_per_token
    notes = []
    if train:
        tokens = b_l * t_l
        if config.remat_policy in ("full", "nothing_saveable"):
            from kdsa.model.transformer import layer_segments
            segs = layer_segments(tuple(kinds))
            carries = sum(r for _, _, r in segs)
            carry = (1 + config.num_attn_res_blocks) * tokens * d * cb
            group = max(sum(per_layer[s:s + p]) for s, p, _ in segs) * tokens * cb
            mem["activations"] = carries * carry + 2 * group
            notes.append(f"remat {config.remat_policy}: {carries} scan-step carries of "
                         f"{_gib(carry)} + one group recomputed ({_gib(2 * group)})")
        else:
            mem["activations"] = sum(per_layer) * tokens * cb
        vocab = _prod(sizes, rules, "vocab")
        mem["logits"] = 2 * tokens * -(-config.vocab_size // vocab) * 4
        if n_moe:
            ep = _prod(sizes, rules, "experts")
            m = tokens * k
            rows = (m if ep == 1 else m * ep if moe_capacity_factor is None
                    else math.ceil(moe_capacity_factor * m))
            i_l = config.moe_intermediate_size / _prod(sizes, rules, "expert_mlp")
            mem["moe_dispatch"] = int(2 * rows * (2 * de + 3 * i_l) * cb)
            if ep > 1 and moe_capacity_factor is None:
                notes.append(f"dropless MoE: expert-parallel buffers sized for the worst case "
                             f"({ep} x the mean, {_gib(mem['moe_dispatch'])}); "
                             f"--moe-capacity-factor sizes them to cf x the mean")
        e = sizes["expert"]
        cf = moe_capacity_factor or 1.0
        comm["expert"] += n_moe * 2 * passes * (e - 1) / e * tokens * k * de * cb * cf
        t = sizes["tensor"]
        comm["tensor"] += len(kinds) * 2 * passes * 2 * (t - 1) / t * tokens * d * cb
        s = sizes["sequence"]
        if s > 1:
            lac = config.linear_attn_config
            h_l = lac.num_heads // tp
            comm["sequence"] += passes * (
                n_kda * (s - 1) * b_l * h_l * lac.head_dim * 2 * lac.head_dim * 4
                + n_dsa * (s - 1) / s * b_l * seq * dsa_cache_bytes_per_token(config))
    else:
        # the recurrent state and the conv window both split their heads over tensor
        kda_seq = kda_cache_bytes_per_sequence(config) // max(
            1, min(tp, config.linear_attn_config.num_heads))
        row = (n_dsa * seq * dsa_cache_bytes_per_token(config, rope_lanes)  # a sequence
               + n_kda * kda_seq)
        mem["caches"] = b_l * row
        mem["prefill"] = max(per_layer) * min(prefill_chunk, b_l * seq) * cb + 2 * row
        mem["logits"] = b_l * -(-config.vocab_size // _prod(sizes, rules, "vocab")) * 4
        e, t = sizes["expert"], sizes["tensor"]
        if "expert" in (rules["act_batch"] or ()):  # tokens to their experts and back
            comm["expert"] += n_moe * 2 * (e - 1) / e * b_l * k * de * cb
        else:  # tokens replicated over expert: psum of the expert outputs
            comm["expert"] += n_moe * 2 * (e - 1) / e * b_l * de * cb
        comm["tensor"] += len(kinds) * 2 * 2 * (t - 1) / t * b_l * d * cb
        notes.append(f"generate: {b_l} sequences per device of up to {seq:,} tokens; "
                     f"communication is per decode step")
    if accum_steps > 1:  # every micro-batch's pass gathers, exchanges and reduces again
        comm = {a: v * accum_steps for a, v in comm.items()}
        notes.append(f"{accum_steps} micro-batches of {batch} sequences per step: activations "
                     f"are one micro-batch's, communication all of theirs")
    return Plan(layout=layout, mesh=sizes, devices=math.prod(sizes.values()), batch=global_batch,
                seq=seq, device_memory=device_memory, memory={k: int(v) for k, v in mem.items()},
                communication={a: int(v) for a, v in comm.items() if v}, notes=tuple(notes),
                accum_steps=accum_steps)


def format_plan(p: Plan, preset: str = "") -> str:
    mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items() if n > 1) or "single device"
    lines = [f"plan: {preset} layout={p.layout} mesh={mesh} ({p.devices} devices) "
             f"batch={p.batch}"
             + (f" in {p.accum_steps} micro-batches" if p.accum_steps > 1 else "")
             + f" seq={p.seq:,}",
             f"{'memory per device':<24}{'GiB':>12}"]
    for name, n in p.memory.items():
        if n:
            lines.append(f"  {name:<22}{n / GiB:>12,.2f}")
    lines.append(f"  {'TOTAL':<22}{p.total / GiB:>12,.2f}   of {p.device_memory / GiB:,.2f} "
                 f"({100 * p.total / p.device_memory:.0f}%)")
    lines.append(f"{'communication per step':<24}{'GiB sent per device':>24}")
    for axis, n in p.communication.items():
        lines.append(f"  {axis:<22}{n / GiB:>12,.3f}")
    lines.extend(f"note: {n}" for n in p.notes)
    lines.append("fits" if p.fits else f"REFUSED: {p.refusal()}")
    return "\n".join(lines)
