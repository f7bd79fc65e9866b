"""Export to Hugging Face: transformers loads the tiny flavour and its logits match torchtitan's;
the CLI picks the newest global checkpoint and ships the tokenizer; AutoModelForCausalLM and
AutoTokenizer load the export, and generation stops at the end-of-text token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from crossfed.cli import main
from crossfed.train.export import ExportError, export_hf, hf_config
from crossfed.train.model import build_model, parameters_of
from crossfed.wire.tensors import save_atomic
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
    out = export_hf(
        parameters_of(model), "tiny", 300, tmp_path / "hf", seq_len=48, eos_id=299, dtype=dtype
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == 300
    assert config["max_position_embeddings"] == 48 and config["eos_token_id"] == 299
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    tolerance = 1e-4 if dtype == "float32" else 0.15  # bf16 weights round the export
    assert torch.allclose(ours, theirs, atol=tolerance)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_config_of_the_paper_model_and_bad_dtype(tmp_path: Path) -> None:
    # the paper's tokenizer: a 131,328-row tied embedding
    config = hf_config("0.6B", 131_328, seq_len=2048, eos_id=131_071)
    assert config["hidden_size"] == 1024 and config["num_hidden_layers"] == 28
    assert config["num_attention_heads"] == 16 and config["head_dim"] == 128
    assert config["vocab_size"] == 131_328 and config["tie_word_embeddings"]
    assert config["max_position_embeddings"] == 2048  # the trained context, not RoPE's 4096
    assert config["eos_token_id"] == config["bos_token_id"] == 131_071
    with pytest.raises(ExportError, match="dtype"):
        export_hf({}, "tiny", 300, tmp_path, seq_len=32, eos_id=0, dtype="float16")
    with pytest.raises(ExportError, match="eos_id 300 outside the vocabulary"):
        hf_config("tiny", 300, seq_len=32, eos_id=300)
    with pytest.raises(ExportError, match="seq_len"):
        hf_config("tiny", 300, seq_len=0, eos_id=0)
    assert not any(tmp_path.iterdir())  # refused before anything was written


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
    meta = json.loads((tiny_data / "meta.json").read_text())
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= written
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 32
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == meta["seq_len"] == 32
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == meta["eos_id"]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.arange(40).reshape(1, 40)
    with torch.no_grad():
        assert torch.allclose(newer(tokens), hf(tokens).logits, atol=1e-4)
    missing = ["export", "--config", str(config), "--out", str(out), "--model", "nope.st"]
    assert main(missing) == 2


DOCUMENT = "The cat sat on the mat."


def model_that_ends_documents(data: Path) -> torch.nn.Module:
    """The tiny flavour trained on one document after another, each ended by end-of-text."""
    meta = json.loads((data / "meta.json").read_text())
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    stream = torch.tensor((tok.encode(DOCUMENT).ids + [meta["eos_id"]]) * 64)
    model = build_model("tiny", vocab_size=meta["vocab_size"], seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    window = 17
    for _ in range(40):
        starts = torch.randint(0, len(stream) - window, (4,), generator=generator)
        batch = torch.stack([stream[s : s + window] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_auto_classes_load_the_export_and_generation_stops_at_eos(
    tiny_data: Path, tmp_path: Path
) -> None:
    meta = json.loads((tiny_data / "meta.json").read_text())
    eos, vocab = meta["eos_id"], meta["vocab_size"]
    params = parameters_of(model_that_ends_documents(tiny_data))
    out = export_hf(
        params, "tiny", vocab, tmp_path / "hf", seq_len=meta["seq_len"], eos_id=eos,
        dtype="float32", tokenizer=tiny_data / "tokenizer.json",
    )  # fmt: skip
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    }  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert model.generation_config.pad_token_id == eos
    assert model.model.embed_tokens.padding_idx is None  # fine-tuning trains the eos row too
    assert model.config.max_position_embeddings == tokenizer.model_max_length == meta["seq_len"]
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == eos
    ours = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    assert tokenizer("The cat").input_ids == ours.encode("The cat").ids  # no token added
    assert tokenizer.decode(ours.encode(DOCUMENT).ids) == DOCUMENT

    prompt = tokenizer("The cat", return_tensors="pt")
    budget = 25
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=budget, do_sample=False)[0]
    new = ids[prompt.input_ids.shape[1] :].tolist()
    assert new[-1] == eos and eos not in new[:-1] and len(new) < budget
    assert tokenizer.decode(ids, skip_special_tokens=True) == DOCUMENT

    # the same weights without the end-of-text ids (the layout before): generate never stops
    for name in ("config.json", "generation_config.json"):
        fields = json.loads((out / name).read_text())
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            fields.pop(key, None)
        (out / name).write_text(json.dumps(fields))
    unended = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ids = unended.generate(**prompt, max_new_tokens=budget, do_sample=False)[0]
    assert len(ids) - prompt.input_ids.shape[1] == budget
