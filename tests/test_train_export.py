"""Export to Hugging Face: transformers loads the tiny flavour and its logits match torchtitan's;
the CLI picks the newest global checkpoint and ships the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crossfed.cli import main
from crossfed.train.export import ExportError, export_hf, hf_config
from crossfed.train.model import build_model, parameters_of
from crossfed.transport import save_atomic
from tests.conftest import write_yaml

transformers = pytest.importorskip("transformers")


def trained_like(vocab: int) -> torch.nn.Module:
    """A tiny model with every weight moved off its initial value (norms included)."""
    model = build_model("tiny", vocab_size=vocab, seed=3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_loads_the_export_and_its_logits_match(tmp_path: Path, dtype: str) -> None:
    model = trained_like(vocab=300)
    out = export_hf(parameters_of(model), "tiny", 300, tmp_path / "hf", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == 300
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    tolerance = 1e-4 if dtype == "float32" else 0.15  # bf16 weights round the export
    assert torch.allclose(ours, theirs, atol=tolerance)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_config_of_the_paper_model_and_bad_dtype(tmp_path: Path) -> None:
    config = hf_config("0.6B", 131_328)  # the paper's tokenizer: a 131,328-row tied embedding
    assert config["hidden_size"] == 1024 and config["num_hidden_layers"] == 28
    assert config["num_attention_heads"] == 16 and config["head_dim"] == 128
    assert config["vocab_size"] == 131_328 and config["tie_word_embeddings"]
    with pytest.raises(ExportError, match="dtype"):
        export_hf({}, "tiny", 300, tmp_path, dtype="float16")


def test_export_command_uses_the_newest_global_checkpoint(tiny_data: Path, tmp_path: Path) -> None:
    vocab = json.loads((tiny_data / "meta.json").read_text())["vocab_size"]
    results = tmp_path / "results"
    older, newer = build_model("tiny", vocab_size=vocab, seed=1), trained_like(vocab)
    save_atomic(parameters_of(older), results / "checkpoints" / "global-2.safetensors")
    save_atomic(parameters_of(newer), results / "checkpoints" / "global-10.safetensors")
    config = write_yaml(
        tmp_path / "config.yaml", {"results": str(results), "data": {"dir": str(tiny_data)}}
    )
    out = tmp_path / "export"
    assert main(["export", "--config", str(config), "--out", str(out), "--dtype", "float32"]) == 0
    assert (out / "tokenizer.json").exists()
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.arange(40).reshape(1, 40)
    with torch.no_grad():
        assert torch.allclose(newer(tokens), hf(tokens).logits, atol=1e-4)
    missing = ["export", "--config", str(config), "--out", str(out), "--model", "nope.st"]
    assert main(missing) == 2
