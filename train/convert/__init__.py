"""kdsa.train.convert: checkpoint conversion between Hugging Face safetensors and kdsa folders.

``kdsa convert hf-to-orbax SRC DST`` / ``orbax-to-hf``; from Python::

    from kdsa.train.convert import hf_to_orbax, orbax_to_hf     # -> Summary

| file | what |
|---|---|
| ``pipeline.py`` | ``hf_to_orbax`` / ``orbax_to_hf``: the streaming jobs, progress, summaries |
| ``plan.py`` | the model config from ``config.json``; every parameter planned and checked against the safetensors headers before anything is written |
| ``read.py`` | producing one stacked parameter from memory-mapped tensors (per-process slices) |
| ``export.py`` | the layout's tensors from a kdsa checkpoint, size-capped shards |
| ``safetensors_io.py`` | the safetensors reader (memory-mapped) and streaming writer |
| ``mappings/`` | the declarative name tables per published layout (Kimi K3, Kimi Linear, DeepSeek-V3.2) |
"""

from kdsa.train.convert.pipeline import (Summary, config_from_hf, hf_to_orbax, orbax_to_hf,
                                         read_hf_config)

__all__ = ["Summary", "config_from_hf", "hf_to_orbax", "orbax_to_hf", "read_hf_config"]
