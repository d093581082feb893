"""Generate the golden reference files in ``tests/data/{kimi_linear,deepseek_v32}/`` (run by hand).

Each folder gets a tiny random model saved by ``transformers``' ``save_pretrained`` (so tensor
names, shapes and ``config.json`` are the published checkpoint layout: ``save_pretrained``
reverts transformers' internal fused weights to the checkpoint names) and ``golden.npz`` with
``input_ids [1, T]`` and the reference implementation's ``logits [1, T, V]`` (float32).
``tests/test_convert.py`` converts each folder and compares our logits with these.

The weights are rounded to bfloat16 before the reference forward and saved in bfloat16, so the
saved files hold exactly the weights the logits were computed with (float32 compute). Norm
weights and the router's selection bias are randomised (all-ones / zeros would hide a swapped
or dropped tensor). Seeds are chosen so every top-k (MoE routing and the DSA indexer) has a gap
of at least ``MIN_GAP`` between the k-th and (k+1)-th score: near-ties would make the selected
set depend on float rounding order.

Regenerate (a separate Python 3.11 venv, CPU torch; transformers' pure-torch fallbacks need the
fla kernels hidden, ``docs/reference/kda.md`` section 4)::

    python3 -m venv /work/main/.venv-golden
    /work/main/.venv-golden/bin/pip install torch==2.13.0          # CPU wheel from local disk
    /work/main/.venv-golden/bin/pip install transformers==5.18.0 safetensors
    /work/main/.venv-golden/bin/python tests/data/make_golden.py

Not run by the tests (no torch in the main venv).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.modules["fla"] = None  # force transformers' pure-torch KDA / conv fallbacks (no Triton on CPU)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

HERE = Path(__file__).resolve().parent
SEQ = 12
MIN_GAP = 1e-4


def kimi_linear_config():
    return transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.446, rms_norm_eps=1e-5, max_position_embeddings=256,
        pad_token_id=63, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3], "num_heads": 2,
                            "head_dim": 16, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, hidden_act="silu", moe_router_activation_func="sigmoid",
        moe_renormalize=True, use_grouped_topk=True,
    )


def deepseek_v32_config():
    return transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=256,
        first_k_dense_replace=1, index_n_heads=8, index_head_dim=16, index_topk=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=63, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )


MODELS = {
    "kimi_linear": (kimi_linear_config, "KimiLinearForCausalLM"),
    "deepseek_v32": (deepseek_v32_config, "DeepseekV32ForCausalLM"),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Noise on norms and the selection bias; every weight rounded to bfloat16 (kept f32)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("norm.bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif name.endswith("gate.weight"):  # router: spread the scores apart
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif "conv1d" in name:
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            t.copy_(t.to(torch.bfloat16).to(torch.float32))


class TopkRecorder:
    """Records every ``torch.topk`` / ``Tensor.topk`` call to check the selection gaps."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._fn, self._method = torch.topk, torch.Tensor.topk
        rec = self

        def fn(x, k, *a, **kw):
            rec.calls.append((x.detach().clone(), int(k)))
            return rec._fn(x, k, *a, **kw)

        def method(self_, k, *a, **kw):
            rec.calls.append((self_.detach().clone(), int(k)))
            return rec._method(self_, k, *a, **kw)

        torch.topk, torch.Tensor.topk = fn, method
        return self

    def __exit__(self, *exc):
        torch.topk, torch.Tensor.topk = self._fn, self._method

    def min_gap(self) -> float:
        gap = np.inf
        for x, k in self.calls:
            v = np.sort(x.float().numpy().reshape(-1, x.shape[-1]), axis=-1)[:, ::-1]
            for row in v:
                row = row[np.isfinite(row) & (row > -1e30)]  # masked: -inf or finfo.min
                if k < row.size:
                    gap = min(gap, float(row[k - 1] - row[k]))
        return gap


def build(layout: str, seed: int):
    make_config, arch = MODELS[layout]
    torch.manual_seed(seed)
    config = make_config()
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).eval()
    randomise(model, seed)
    ids = torch.randint(0, config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    with TopkRecorder() as rec, torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    return model, ids, logits, rec.min_gap()


def main() -> None:
    for layout in MODELS:
        for seed in range(100):
            model, ids, logits, gap = build(layout, seed)
            if gap >= MIN_GAP:
                break
        else:
            raise SystemExit(f"{layout}: no seed with top-k gaps >= {MIN_GAP}")
        out = HERE / layout
        shutil.rmtree(out, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        np.savez(out / "golden.npz", input_ids=ids.numpy().astype(np.int32),
                 logits=logits.numpy().astype(np.float32))
        (out / "golden.json").write_text(json.dumps(
            {"transformers": transformers.__version__, "torch": torch.__version__, "seed": seed,
             "min_topk_gap": gap}, indent=2) + "\n")
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{layout}: seed {seed}, min top-k gap {gap:.2e}, {size / 1024:.0f} KiB -> {out}")


if __name__ == "__main__":
    main()
