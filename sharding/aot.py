"""Compiling for a named TPU topology on this host (no TPU needed): its abstract devices, the
chips' HBM, and XLA's per-device memory of a compiled program.

``topology_devices("v5p:8x8x16")`` gives the abstract devices of
``jax.experimental.topologies.get_topology_desc`` (libtpu, the XLA:TPU compiler, must import);
``compiled_memory(compiled, seconds)`` reads ``memory_analysis()`` and counts the collectives
in the compiled HLO (so a report shows, e.g., that the MoE's expert-parallel exchange is the
``ragged-all-to-all`` of ``model/expert_parallel.py``) and the Pallas (Mosaic) kernels in it
(so a report with ``attention_impl="pallas"`` shows the sparse MLA kernel inside the step). Used
by ``train/aot.py`` (the train step) and ``infer/aot.py`` (the generate steps), both behind
``kdsa plan --compile``.

Per-device peak = arguments + outputs - aliased + temporaries + code. HBM per chip (per
TensorCore device, as ``jax.devices()`` sees it), from the public chip specs: v4 32 GiB, v5e
16 GiB, v5p 95 GiB, v6e 32 GiB.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

GiB = 1 << 30
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
CHIP_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB,
            "v6e": 32 * GiB}


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device bytes of one compiled program, and its compile time."""
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    compile_seconds: float
    collectives: dict = dataclasses.field(default_factory=dict)  # HLO op -> count
    kernels: dict = dataclasses.field(default_factory=dict)  # Mosaic kernel name -> count

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


def chip_hbm(topology: str) -> int | None:
    """HBM bytes per device of a topology name such as ``v5p:8x8x16`` (None: unknown chip)."""
    return CHIP_HBM.get(topology.split(":", 1)[0].split("-", 1)[0])


def topology_devices(topology: str) -> list:
    """The abstract devices of ``topology`` (``v5e:2x2``, ``v5p:8x8x16``, ...); a clear error
    without libtpu."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401 - only whether it imports
    except ImportError:
        raise ValueError("--compile needs libtpu (the XLA:TPU compiler): pip install libtpu, "
                         "or the test extra (pip install -e '.[test]')") from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology, platform="tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu's message names the problem
        raise ValueError(f"--topology {topology}: {str(e).splitlines()[0]}") from None


def compiled_memory(compiled, seconds: float) -> CompiledMemory:
    """The per-device memory of a ``jax.stages.Compiled`` program, and its collectives."""
    m = compiled.memory_analysis()
    return CompiledMemory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                          aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                          code=m.generated_code_size_in_bytes, compile_seconds=round(seconds, 1),
                          collectives=count_collectives(hlo := compiled.as_text()),
                          kernels=count_kernels(hlo))


def count_collectives(hlo: str) -> dict[str, int]:
    """``{op: count}`` of the collective ops in an HLO text (async pairs counted once, by their
    ``-start``), only those present."""
    ops = "|".join(re.escape(op) for op in sorted(COLLECTIVES, key=len, reverse=True))
    found = collections.Counter(
        m.group(1) for m in re.finditer(rf"[\s)]({ops})(?:-start)?\(", hlo))
    return {op: found[op] for op in COLLECTIVES if found[op]}


def count_kernels(hlo: str) -> dict[str, int]:
    """``{kernel: count}`` of the Mosaic custom calls in an HLO text, by the kernel's name (the
    instruction is named after it, e.g. ``%sparse_mla_fwd_tpu.1 = ... tpu_custom_call``, or
    ``%sparse_mla_bwd_tpu.2.clone``); a kernel in a loop body counts once."""
    return dict(collections.Counter(
        m.group(1) for m in re.finditer(r"%([A-Za-z_][\w-]*?)(?:\.[\w-]+)* = [^\n]*"
                                        r'custom_call_target="tpu_custom_call"', hlo)))


def unfused_instructions(hlo: str) -> list[str]:
    """The lines of an optimized HLO module outside fusion bodies: the instructions computed
    into buffers of their own (a copy or slice there is memory traffic, inside a fusion not)."""
    fused = {"%" + n for n in re.findall(r"calls=%([\w.\-]+)", hlo)}
    out, inside = [], False
    for ln in hlo.splitlines():
        if ln and not ln.startswith(" ") and ln.rstrip().endswith("{"):
            inside = ln.split()[0] in fused
        elif not inside:
            out.append(ln)
    return out
