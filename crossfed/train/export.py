"""Export a global model to the Hugging Face layout: ``model.safetensors`` + ``config.json``.

Weights go through torchtitan's ``Qwen3StateDictAdapter.to_hf`` (fused QKV split back into
q/k/v by the model's own state-dict hooks, tied ``lm_head`` left out); the ``config.json`` is
built here from the flavour's torchtitan config, so nothing is downloaded. ``transformers``'
``Qwen3ForCausalLM.from_pretrained(out_dir)`` loads the result.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from crossfed.train.model import build_model, load_parameters, model_config
from crossfed.transport import save_atomic

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(ValueError):
    """A model that cannot be written in the Hugging Face layout."""


def hf_config(flavour: str, vocab_size: int, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``Qwen3Config`` of a crossfed/torchtitan Qwen3 flavour."""
    config = model_config(flavour, vocab_size=vocab_size)
    layer = config.layers[0]
    attention = layer.attention
    rope = attention.rope
    if getattr(rope, "scaling", "none") != "none":
        raise ExportError(f"flavour {flavour!r} uses RoPE scaling {rope.scaling!r}; not exported")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": layer.feed_forward.w1.out_features,
        "num_hidden_layers": len(config.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": config.norm.eps,
        "rope_theta": rope.theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope.theta},
        "tie_word_embeddings": bool(config.enable_weight_tying),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def hf_state_dict(
    tensors: Mapping[str, torch.Tensor], flavour: str, vocab_size: int
) -> dict[str, torch.Tensor]:
    """crossfed's parameter map (the wire/checkpoint layout) in Hugging Face names."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    model = build_model(flavour, vocab_size=vocab_size)
    load_parameters(model, tensors)
    adapter = Qwen3StateDictAdapter(model_config(flavour, vocab_size=vocab_size), None)
    return adapter.to_hf(model.state_dict())


def export_hf(
    tensors: Mapping[str, torch.Tensor],
    flavour: str,
    vocab_size: int,
    out_dir: Path,
    *,
    dtype: str = "bfloat16",
    tokenizer: Path | None = None,
) -> Path:
    """Write ``out_dir/{model.safetensors,config.json}`` (and ``tokenizer.json`` if given)."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = hf_state_dict(tensors, flavour, vocab_size)
    weights = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    save_atomic(weights, out_dir / "model.safetensors", {"format": "pt"})
    config = hf_config(flavour, vocab_size, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None and Path(tokenizer).exists():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return out_dir
