"""Byte-level BPE training and loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from crossfed.data.corpus import embedded_documents
from crossfed.data.tokenizer import (
    EOS_TOKEN,
    TokenizerError,
    eos_id,
    load_tokenizer,
    train_tokenizer,
    vocab_size,
)

VOCAB = 300


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [d.text for d in embedded_documents(max_documents=40)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    return train_tokenizer(texts, VOCAB, tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(tok_path: Path) -> Tokenizer:
    return load_tokenizer(tok_path)


def test_trained_vocab_size_and_eos(tok: Tokenizer) -> None:
    assert vocab_size(tok) == VOCAB
    assert tok.get_vocab_size() == VOCAB
    assert eos_id(tok) == tok.token_to_id(EOS_TOKEN)
    ids = tok.encode(f"one{EOS_TOKEN}two", add_special_tokens=False).ids
    assert ids.count(eos_id(tok)) == 1


def test_bpe_merges_common_words(tok: Tokenizer) -> None:
    text = "the function returns the value of the object"
    assert len(tok.encode(text).ids) < 0.8 * len(text.encode())  # 43 merges already help


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x  # plain ASCII\n\n\ttabs  and   spaces ",
        "Grüße, 世界! naïve café — ☃ 𝔘 \u200b end",
        " leading space and trailing newline\n",
        "",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text).ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    # a text holding the separator's own spelling encodes it as the separator (one id, as a
    # document boundary): kept by the decoder, it comes back as written (hypothesis draws
    # the spelling from the module's constants)
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_the_separators_spelling_in_a_text_comes_back_from_its_one_id(tok: Tokenizer) -> None:
    text = f"a{EOS_TOKEN}b"
    ids = tok.encode(text).ids
    assert ids.count(eos_id(tok)) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_training_is_deterministic(tmp_path: Path, texts: list[str], tok_path: Path) -> None:
    again = train_tokenizer(texts, VOCAB, tmp_path / "again.json")
    assert again.read_bytes() == tok_path.read_bytes()


def test_vocab_too_small(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="vocab_size must be at least 257"):
        train_tokenizer(["abc"], 200, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_load_accepts_a_directory(tok_path: Path) -> None:
    assert vocab_size(load_tokenizer(tok_path.parent)) == VOCAB


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="invalid JSON"):
        load_tokenizer(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(TokenizerError, match="not a valid HF tokenizer file"):
        load_tokenizer(wrong)


def test_eos_of_other_tokenizer_families(tmp_path: Path) -> None:
    other = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        eos_id(other)
    other.add_special_tokens(["</s>"])
    assert eos_id(other) == 3
    other.add_special_tokens(["<sep>"])
    assert eos_id(other, "<sep>") == 4
    with pytest.raises(TokenizerError, match="looked for <missing>"):
        eos_id(other, "<missing>")
