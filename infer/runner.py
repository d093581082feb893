"""The model side of generation: jitted prefill and decode steps over a fixed set of cache slots.

``ModelRunner`` owns the decode cache (``Transformer.init_cache(num_slots, max_len)``: leaves
``[repeats, slots, ...]``, the slot axis is axis 1) and two compiled steps:

* ``prefill(slot, tokens, start)``: one chunk of one request's prompt, padded to a length
  bucket (powers of two from ``min_bucket`` to ``prefill_chunk``; right padding marked by
  ``segment_ids = 0``), run on that slot's cache row (read and written back with a dynamic
  slice of axis 1, or a one-hot select when the slots are split over devices: ``take_slot``),
  its DSA caches cut to the context width the chunk's end needs, and zeroed when ``start == 0``
  so a reused slot starts clean (past the width old keys stay, behind the causal mask).
  Returns the logits of the chunk's last real token ``[1, V]``. A prompt longer than
  ``prefill_chunk`` is prefilled chunk by chunk (the KDA state and DSA cache continue).
* ``decode(tokens, positions, active)``: one token for every slot ``[S]``, each at its own
  position; inactive slots are padding (``segment_ids = 0``: their KDA state and DSA cache are
  left as they are). Returns logits ``[S, V]``.

Shapes are static, so prefill compiles once per bucket and decode once. The cache is donated to
each step. With the paged cache the decode step reads the first :meth:`ModelRunner.table_width`
columns of the block table, enough for the furthest active row, so its cost follows the
context in use rather than ``max_len`` (one decode compile per width: powers of two from
``MIN_TABLE_PAGES`` to ``max_pages``, all compiled by :meth:`ModelRunner.warmup`). A prefill
chunk reads the same widths up to its end (paged, or the first positions of a dense slot on
one device), so a short prompt in a long-context server does not scan ``max_len`` keys.

``record_routing`` (RL routing replay): both steps also return the experts every MoE layer used
for the tokens they ran, kept on the host in ``last_routing`` (``[tokens, L_moe, k]`` int32 for
a prefill chunk's real tokens, ``[S, L_moe, k]`` for a decode step; the MoE layers in order).

On one CPU device the decode step reads the scanned layers' weights as per-layer arrays
(``model/transformer.py : per_layer_state``, a copy beside the model's stacked arrays) when a
repeated layer's weights are large (``PER_LAYER_MIN_BYTES``): XLA:CPU otherwise copies each
layer's weights out of the stacked arrays at every step.

With a ``mesh`` (``docs/sharding.md``) the runner works on the ``generate`` layout:

* weights: a model whose arrays already live on a mesh (the trainer's ``train`` layout, an RL
  policy) is moved array by array with ``sharding.reshard.reshard_model`` (the report is kept
  in ``reshard_report``); host-built weights are placed by ``rules.shard_model`` (each process
  fills its own shards);
* cache: the slot axis is split over the layout's ``act_batch`` axes (data x fsdp x expert:
  "DP attention", each device caches its own requests), so ``num_slots`` must be a multiple
  of their product (checked, clear error); a paged pool and the KDA snapshots are split into
  one partition per device group of those axes (``partitions``; ``infer/runner_pages.py``,
  ``model/paged_attention.py``);
* both steps are traced and run inside ``use_sharding(mesh, layout)``: the model's activation
  constraints, expert-parallel MoE and the rules apply; the logits come back replicated, so
  every process samples the same tokens (multi-host: all processes step in lockstep).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, make_single_device_sharding

from kdsa.infer.cache_layout import cache_shardings, rope_lanes_for, row_major
from kdsa.infer.runner_pages import PagedSlots
from kdsa.infer.runner_steps import (copy_page, copy_page_jit, encode_step, prefill_batch_step,
                                     restore_state, restore_state_jit, save_state,
                                     save_state_jit, shared_batch_step, shared_steps, states,
                                     step_pair)
from kdsa.model.paged_cache import PAGE_SIZE, pages_for
from kdsa.model.transformer import per_layer_state, repeated_layer_bytes


def length_buckets(min_bucket: int, max_bucket: int) -> tuple[int, ...]:
    """Powers of two from ``min_bucket`` up to ``max_bucket`` (which is always included)."""
    if min_bucket < 1 or max_bucket < min_bucket:
        raise ValueError(f"need 1 <= min_bucket <= prefill_chunk, got {min_bucket}, "
                         f"{max_bucket}")
    out, b = [], min_bucket
    while b < max_bucket:
        out.append(b)
        b *= 2
    return tuple(out) + (max_bucket,)


class ModelRunner(PagedSlots):
    def __init__(self, model, *, num_slots: int, max_len: int, prefill_chunk: int = 256,
                 min_bucket: int = 16, mesh=None, layout: str = "generate",
                 compiler_options: dict | None = None, record_routing: bool = False,
                 num_pages: int | None = None, num_snapshots: int = 0,
                 batch_prefill: bool = False):
        cfg = model.config
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        limit = cfg.context_limit  # None: NoPE, no position limit
        if max_len < 1 or (limit is not None and max_len > limit):
            raise ValueError(f"max_len={max_len} must be in [1, max_position_embeddings="
                             f"{limit}] (this model encodes positions with RoPE)")
        self.config, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.vocab_size = cfg.vocab_size
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.buckets = length_buckets(min(min_bucket, self.prefill_chunk), self.prefill_chunk)
        self.mesh, self.layout, self.reshard_report = mesh, layout, None
        self.record_routing, self.last_routing = record_routing, None
        self.batch_prefill = batch_prefill
        jit = functools.partial(jax.jit, donate_argnums=(1,), compiler_options=compiler_options)
        self.num_pages, self.block_table = num_pages, None
        self.max_pages = pages_for(max_len)  # (the context widths count pages, paged or not)
        # on a mesh the slots, the page pool and the KDA snapshots are split alike into
        # ``partitions`` device groups (the layout's batch axes: model/paged_attention.py)
        self.partitions = 1 if mesh is None else self._place_weights(model)
        # without a mesh: the device the weights live on (its cache placed there on TPU)
        self.device = None if mesh is not None else _weights_device(model)
        self.num_snapshots, self.snapshots = num_snapshots, None
        self._check_partitions(num_pages, num_snapshots)
        lanes = rope_lanes_for(mesh, self.device)  # TPU: the RoPE keys in 128 columns
        if num_pages is not None:  # DSA rows in pages of one shared pool (model/paged_cache.py)
            make = lambda: row_major(model.init_paged_cache(  # noqa: E731
                num_slots, num_pages, self.max_pages, self.partitions, lanes).layers)
            self.block_table = np.full((num_slots, self.max_pages), -1, np.int32)
        else:
            make = lambda: row_major(model.init_cache(num_slots, max_len, lanes))  # noqa: E731
        snapshot_of = lambda c: states(lambda a: jnp.zeros(  # noqa: E731
            (a.shape[0], num_snapshots) + a.shape[2:], a.dtype), c)
        if num_snapshots and num_pages is None:
            raise ValueError("KDA state snapshots (prefix caching) need a paged cache")
        # None: the default placement (one CPU or GPU device); else a mesh's, or one TPU
        # device's (the DSA buffers row-major: infer/cache_layout.py)
        cache_sh = self.cache_shardings(jax.eval_shape(make))
        # (kept: a failed step's donated buffers are rebuilt empty, ``PagedSlots.lost_buffers``)
        self._new_cache = make if cache_sh is None else jax.jit(make, out_shardings=cache_sh)
        self.cache = self._new_cache()
        if cache_sh is None:
            self._copy_page, self._save = copy_page_jit, save_state_jit
            self._restore = restore_state_jit
        else:
            # logits on every device (all processes sample alike); the cache stays put
            rep = (make_single_device_sharding(self.device) if mesh is None
                   else NamedSharding(mesh, P()))
            jit = functools.partial(jit, out_shardings=(rep, cache_sh) + (
                (rep,) if record_routing else ()))
            snap_sh = self.cache_shardings(jax.eval_shape(snapshot_of, self.cache))
            self._copy_page = jax.jit(copy_page, donate_argnums=(0,), out_shardings=cache_sh)
            self._save = jax.jit(save_state, donate_argnums=(1,), out_shardings=snap_sh)
            self._restore = jax.jit(restore_state, donate_argnums=(0,), out_shardings=cache_sh)
        if num_snapshots:  # KDA states of the prefix cache (infer/prefix_cache.py)
            self._new_snapshots = jax.jit(snapshot_of, out_shardings=None if cache_sh is None
                                          else snap_sh)
            self.snapshots = self._new_snapshots(self.cache)
        self.graphdef, self.state = nnx.split(model)
        # the decode step on one CPU device reads per-layer weight arrays when a repeated
        # layer's weights are large (module docstring); decided once from the shapes, the
        # arrays built from the current weights at the first decode after they change
        self._segment_layout = model.segment_layout
        self._per_layer_decode = (mesh is None and _on_cpu(self.state) and repeated_layer_bytes(
            self.state, self._segment_layout) >= PER_LAYER_MIN_BYTES)
        self._decode_weights = (None, None)  # (the weights' leaves it was built from, state)
        if cache_sh is None:  # runners of one model structure share their compiled steps
            # (with a mesh or on one TPU each runner compiles its own, with its cache's
            # shardings and layouts as outputs)
            options = tuple(sorted((compiler_options or {}).items()))
            self._prefill, self._decode = shared_steps(self.graphdef, record_routing, options)
            self._prefill_batch = shared_batch_step(self.graphdef, options)
        else:
            self._prefill, self._decode = step_pair(jit, self.graphdef, record_routing)
            self._prefill_batch = jax.jit(  # (one device only: ``batched_prefill``)
                functools.partial(prefill_batch_step, self.graphdef), donate_argnums=(1,),
                compiler_options=compiler_options, static_argnames=("width",),
                out_shardings=(rep, cache_sh))
        self._encode = jax.jit(functools.partial(encode_step, self.graphdef))

    def decode_state(self):
        """The weights the decode step reads: ``state``, or on one CPU device its per-layer
        form (``per_layer_state``), rebuilt whenever any weight array changed (a new
        ``state``, or the model updated in place: ``nnx.split`` shares its Variables). Prefill
        keeps the stacked arrays: a k3-slice 256-token chunk at depth 32K measured 2.2 s on
        either (alternating in one process)."""
        if not self._per_layer_decode:
            return self.state
        leaves = jax.tree.leaves(self.state)
        built_from, state = self._decode_weights
        if built_from is None or len(built_from) != len(leaves) or any(
                a is not b for a, b in zip(built_from, leaves)):
            state = per_layer_state(self.state, self._segment_layout)
            self._decode_weights = (leaves, state)
        return state

    def _place_weights(self, model) -> int:
        """Check the layout fits, then reshard on-mesh weights or place host-built ones.
        Returns the number of device groups the layout's batch axes make."""
        from kdsa.sharding.mesh import check_layout
        from kdsa.sharding.reshard import reshard_model
        from kdsa.sharding.rules import batch_groups, shard_model

        sizes = dict(self.mesh.shape)
        check_layout(self.config, sizes, self.layout)
        axes, k = batch_groups(self.mesh, self.layout)
        if self.num_slots % k:
            raise ValueError(
                f"num_slots={self.num_slots} must be a multiple of the {self.layout} layout's "
                f"batch axes {'x'.join(f'{a}={sizes[a]}' for a in axes)} (product {k}): the "
                f"cache's slot axis is split over them (--slots)")
        leaves = jax.tree.leaves(nnx.state(model))
        if leaves and all(isinstance(getattr(x, "sharding", None), NamedSharding)
                          for x in leaves):
            self.reshard_report = reshard_model(model, self.mesh, self.layout)
        else:
            shard_model(model, self.mesh, self.layout)
        return k

    def cache_shardings(self, cache):
        return cache_shardings(cache, self.mesh, self.layout, self.device)

    def _rules(self):
        """The layout's rules while tracing and calling the steps (part of jit's cache key)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from kdsa.sharding.constrain import use_sharding
        return use_sharding(self.mesh, self.layout)

    def _args(self, *xs):
        """Host inputs of a step; on a multi-process mesh, replicated global arrays (each
        process fills its own devices from its identical copy)."""
        if self.mesh is None or not self.mesh.is_multi_process:
            return xs
        from kdsa.sharding.rules import place
        rep = NamedSharding(self.mesh, P())
        return tuple(None if x is None else place(np.asarray(x), rep) for x in xs)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"chunk of {n} tokens exceeds prefill_chunk={self.prefill_chunk}")

    def prefill(self, slot: int, tokens, start: int = 0, image_embeds=None,
                image_mask=None) -> jax.Array:
        """One prompt chunk into ``slot`` at positions ``start..`` -> last-token logits [1, V].

        With a vision tower, ``image_embeds [n, D]`` replace the embeddings where
        ``image_mask [n]`` is set (the chunk's image placeholders, from :meth:`encode_images`);
        a vision model always passes them (zeros when none), so each bucket compiles once."""
        n = len(tokens)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        if n < 1 or start < 0 or start + n > self.max_len:
            raise ValueError(f"prefill of {n} tokens at {start} does not fit max_len "
                             f"{self.max_len}")
        b = self.bucket(n)
        ids = np.zeros((1, b), np.int32)
        ids[0, :n] = tokens
        emb = mask = None
        if self.config.vision_config is not None:
            emb = np.zeros((1, b, self.config.hidden_size), np.float32)
            mask = np.zeros((1, b), bool)
            if image_embeds is not None:
                emb[0, :n], mask[0, :n] = image_embeds, image_mask
        elif image_embeds is not None:
            raise ValueError("this model has no vision tower: no image embeddings")
        table, width = self._context(start + n)
        table = None if table is None else table[slot].copy()
        args = self._args(np.int32(slot), ids, np.int32(start), np.int32(n),
                          np.bool_(start == 0), emb, mask, table)
        with self._rules():
            logits, self.cache, *routing = self._prefill(self.state, self.cache, *args,
                                                         width=width)
        if routing:
            self.last_routing = _host(routing[0])[:n]                     # [n, L_moe, k]
        return logits

    @property
    def batched_prefill(self) -> bool:
        """Whether :meth:`prefill_batch` can run several slots' chunks in one step: one device,
        text only, no routing records (otherwise the engine prefills one slot at a time)."""
        return (self.batch_prefill and self.mesh is None and self.num_slots > 1
                and self.config.vision_config is None and not self.record_routing)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Row counts a batched prefill pads to: powers of two from 2, and ``num_slots``."""
        return tuple(sorted({min(1 << k, self.num_slots)
                             for k in range(1, max(1, self.num_slots - 1).bit_length() + 1)}))

    def prefill_batch(self, slots, chunks, starts) -> jax.Array:
        """Prompt chunks of several slots in one step: ``chunks[r]`` into ``slots[r]`` at
        positions ``starts[r]..`` -> last-token logits ``[rows, V]``, row ``r < n`` for
        ``slots[r]`` (the rest are padding: the sampler sees few shapes). Rows pad to a
        :attr:`row_buckets` count (padding rows read zeros and write nothing) and tokens to the
        longest chunk's length bucket, so shapes compile once per (rows, bucket)."""
        n = len(slots)
        if not self.batched_prefill:
            raise ValueError("batched prefill runs on one device, text only, without routing "
                             "records")
        if not 1 <= n <= self.num_slots or len(set(slots)) != n or len(chunks) != n \
                or len(starts) != n:
            raise ValueError(f"need 1..{self.num_slots} distinct slots with a chunk and a start "
                             f"each, got slots {list(slots)}")
        rows = next(r for r in self.row_buckets if r >= n)
        b = self.bucket(max(len(c) for c in chunks))
        ids = np.zeros((rows, b), np.int32)
        slot_ids = np.full(rows, self.num_slots, np.int32)  # out of range: dropped
        st, ln = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, (slot, chunk, start) in enumerate(zip(slots, chunks, starts)):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
            if len(chunk) < 1 or start < 0 or start + len(chunk) > self.max_len:
                raise ValueError(f"prefill of {len(chunk)} tokens at {start} does not fit "
                                 f"max_len {self.max_len}")
            ids[r, :len(chunk)], slot_ids[r], st[r], ln[r] = chunk, slot, start, len(chunk)
        cut, width = self._context(int((st + ln).max()))
        table = None
        if cut is not None:
            table = np.full((rows, cut.shape[1]), -1, np.int32)
            table[:n] = cut[list(slots)]
        logits, self.cache = self._prefill_batch(self.state, self.cache, slot_ids, ids, st, ln,
                                                 (st == 0) & (ln > 0), table, width=width)
        return logits

    def _context(self, end: int) -> tuple[np.ndarray | None, int | None]:
        """What a prefill whose rows end by position ``end`` reads of the DSA caches, so that its
        indexer scores (and dense MLA attends) the context in use rather than ``max_len``
        (the keys past ``end`` are invisible to its queries: the same keys are selected): the
        block table cut to :meth:`table_width` pages (paged), or ``width`` positions, the same
        widths in tokens (dense slots, one device; on a mesh all ``max_len``)."""
        if self.block_table is not None:
            return self.block_table[:, :self.table_width(pages_for(end))], None
        if self.mesh is not None:
            return None, None
        width = self.table_width(pages_for(end)) * PAGE_SIZE
        return None, (None if width >= self.max_len else width)

    def encode_images(self, images) -> np.ndarray:
        """Patched images of one request (prompt order) -> features ``[tokens, D]`` float32:
        tower + merge + projector, patches padded to a power of two (>= 64) so few shapes
        compile."""
        from kdsa.model.vision.assemble import pack_images

        need = sum(im.num_patches for im in images)
        batch = pack_images([list(images)], max(64, 1 << (need - 1).bit_length()))
        feats = self._encode(self.state, batch)
        return np.asarray(feats)[0, :sum(im.num_tokens for im in images)]

    def decode(self, tokens, positions, active) -> jax.Array:
        """tokens, positions [S] int32, active [S] bool -> logits [S, V] float32.

        Paged: the block table is cut to the width the furthest active row needs (the indexer
        scans only that many pages; the selected keys are the same, as no row has keys past
        its position)."""
        positions, active = np.asarray(positions, np.int32), np.asarray(active, bool)
        far = int(positions[active].max()) if active.any() else 0
        table = self._context(far + 1)[0]  # (dense slots: decode reads every position)
        table = None if table is None else table.copy()
        args = self._args(np.asarray(tokens, np.int32), positions, active, table)
        with self._rules():
            logits, self.cache, *routing = self._decode(self.decode_state(), self.cache, *args)
        if routing:
            self.last_routing = _host(routing[0])                         # [S, L_moe, k]
        return logits

    def warmup(self) -> None:
        """Compile every prefill bucket (one slot, and every row count of a batched prefill)
        at the narrowest context width, the largest bucket (a long prompt's chunks) at every
        width, and the decode step at every block-table width when paged (on the slots, which
        are then reset by the next prefill into them). Other (bucket, width) pairs, e.g. a short
        suffix after a deep prefix-cache hit, and batched prefills past the narrowest width
        compile when first used. With the prefix cache, its copies (a slot's KDA states to a
        snapshot and back, a page to a page) compile here too: the engine admits a request
        with them. Only on a runner holding no request's pages (it writes into the slots)."""
        if self.block_table is not None and (self.block_table >= 0).any():
            raise RuntimeError("warmup writes into every slot: call it before any request "
                               "holds pages, not on a runner in use")
        for b in self.buckets:
            self.prefill(0, [0] * b, 0)
            for rows in self.row_buckets if self.batched_prefill else ():
                self.prefill_batch(list(range(rows)), [[0] * b] * rows, [0] * rows)
        b = self.buckets[-1]
        cuts = self.block_table is not None or self.mesh is None  # (on a mesh: no widths)
        for w in self.table_widths[1:] if cuts else ():
            if w * PAGE_SIZE >= b:  # a chunk ending at the width's last position
                self.prefill(0, [0] * b, min(w * PAGE_SIZE, self.max_len) - b)
        s = self.num_slots
        for w in self.table_widths if self.block_table is not None else (1,):
            pos = np.full(s, (w - 1) * PAGE_SIZE, np.int32)  # compiles the width of ``w``
            self.decode(np.zeros(s, np.int32), pos, np.ones(s, bool) if w > 1 else
                        np.zeros(s, bool))
        if self.num_snapshots:  # slot 0 and snapshot 0 hold nothing yet: reset when used
            self.save_state(0, 0)
            self.restore_state(0, 0)
            self.copy_page(0, 0, slot=0)


def _host(x) -> np.ndarray:
    """A replicated step output on the host (a multi-process mesh: this process's copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


# Per-layer decode weights pay off when copying a layer's weights costs more than the longer
# unrolled program: a k3-slice decode step (560 MB per repeated layer) went 358 -> 169 ms at
# 32K, a tiny one (0.18 MB) 0.9-1.1 -> 1.3 ms at 4K (bench_model_decode, bench_long_context
# --step-only, 2026-12-05). Above this many bytes per repeated layer, past the CPU's caches:
PER_LAYER_MIN_BYTES = 32 << 20


def _weights_device(model):
    """The device a model's weights live on (the first array's), else this process's first."""
    leaves = jax.tree.leaves(nnx.state(model))
    devices = getattr(leaves[0], "devices", None) if leaves else None
    return next(iter(devices())) if devices else jax.local_devices()[0]


def _on_cpu(state) -> bool:
    """Whether the weights live on CPU devices (XLA:CPU copies a scanned layer's weights out of
    their stacked arrays each step: ``per_layer_state``)."""
    leaves = jax.tree.leaves(state)
    return bool(leaves) and all(d.platform == "cpu" for d in leaves[0].devices())
