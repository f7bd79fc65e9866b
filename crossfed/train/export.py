"""Export a global model to the Hugging Face layout, as ``save_pretrained`` writes it.

Weights go through torchtitan's ``Qwen3StateDictAdapter.to_hf`` (fused QKV split back into
q/k/v by the model's own state-dict hooks, tied ``lm_head`` left out) into
``model.safetensors``. ``config.json`` and ``generation_config.json`` are written by
``transformers``' own ``Qwen3Config`` and ``GenerationConfig``, with the end-of-text id as
``eos_token_id`` (so ``generate`` stops there) and the trained sequence length as
``max_position_embeddings``; the tokenizer goes through ``PreTrainedTokenizerFast`` with its
bos/eos/pad tokens and ``model_max_length`` set (``tokenizer.json``,
``tokenizer_config.json``). ``AutoModelForCausalLM`` and ``AutoTokenizer`` load the folder;
nothing is downloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from crossfed.train.model import build_model, load_parameters, model_config
from crossfed.wire.tensors import save_atomic

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Start-of-text tokens of common tokenizer families; without one, bos is the end-of-text token
# (GPT-2's convention: crossfed's data put it between documents, so it also starts each one).
BOS_CANDIDATES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>")


class ExportError(ValueError):
    """A model that cannot be written in the Hugging Face layout."""


def hf_config(
    flavour: str,
    vocab_size: int,
    *,
    seq_len: int,
    eos_id: int,
    bos_id: int | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """The Hugging Face ``Qwen3Config`` fields of a crossfed/torchtitan Qwen3 flavour.

    ``seq_len`` is the trained context (``max_position_embeddings``); ``eos_id`` the
    end-of-text token that ends generation; ``bos_id`` defaults to ``eos_id``.
    """
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if seq_len < 1:
        raise ExportError(f"seq_len must be at least 1, got {seq_len}")
    bos_id = eos_id if bos_id is None else bos_id
    for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
        if not 0 <= value < vocab_size:
            raise ExportError(f"{name} {value} outside the vocabulary (size {vocab_size})")
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
        "max_position_embeddings": seq_len,
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope.theta},
        "tie_word_embeddings": bool(config.enable_weight_tying),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # no pad id here: transformers makes it the embedding's padding_idx, whose row then
        # gets no gradient when the export is fine-tuned (generation_config.json has it)
        "pad_token_id": None,
        "dtype": dtype,
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


def bos_id_of(tokenizer: Path, eos_id: int) -> int:
    """The tokenizer's start-of-text id (a known bos token), else ``eos_id``."""
    from crossfed.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    for name in BOS_CANDIDATES:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    return eos_id


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ExportError(
            "crossfed export writes the files with transformers; install it "
            "(pip install -e '.[hf]' in the crossfed checkout, or pip install transformers==5.23.0)"
        ) from exc
    return transformers


def save_tokenizer(
    tokenizer: Path, out_dir: Path, *, eos_id: int, bos_id: int, seq_len: int
) -> list[str]:
    """The tokenizer as ``PreTrainedTokenizerFast.save_pretrained`` writes it; the file names."""
    transformers = _transformers()
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    eos = wrapped.convert_ids_to_tokens(eos_id)
    bos = wrapped.convert_ids_to_tokens(bos_id)
    if eos is None or bos is None:
        raise ExportError(f"{tokenizer}: no token with id {eos_id if eos is None else bos_id}")
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer),
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        model_max_length=seq_len,
        clean_up_tokenization_spaces=False,  # byte-level BPE: decode gives the text back
    )
    return [Path(name).name for name in wrapped.save_pretrained(str(out_dir))]


def export_hf(
    tensors: Mapping[str, torch.Tensor],
    flavour: str,
    vocab_size: int,
    out_dir: Path,
    *,
    seq_len: int,
    eos_id: int,
    dtype: str = "bfloat16",
    tokenizer: Path | None = None,
) -> Path:
    """Write ``out_dir`` as ``save_pretrained`` would: weights, model, generation and tokenizer
    configs (the tokenizer files only if ``tokenizer`` is given)."""
    transformers = _transformers()
    bos_id = bos_id_of(Path(tokenizer), eos_id) if tokenizer is not None else eos_id
    fields = hf_config(
        flavour, vocab_size, seq_len=seq_len, eos_id=eos_id, bos_id=bos_id, dtype=dtype
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = hf_state_dict(tensors, flavour, vocab_size)
    weights = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    save_atomic(weights, out_dir / "model.safetensors", {"format": "pt"})
    config = transformers.Qwen3Config(**fields)
    config.save_pretrained(str(out_dir))
    generation = transformers.GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    generation.save_pretrained(str(out_dir))
    written = ["model.safetensors", "config.json", "generation_config.json"]
    if tokenizer is not None:
        written += save_tokenizer(
            Path(tokenizer), out_dir, eos_id=eos_id, bos_id=bos_id, seq_len=seq_len
        )
    logger.info("wrote %s: %s", out_dir, ", ".join(written))
    return out_dir
