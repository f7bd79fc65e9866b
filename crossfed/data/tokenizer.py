"""Byte-level BPE tokenizer: train one with HF ``tokenizers`` or load a user's tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from crossfed.fileio import atomic_file

EOS_TOKEN = "<|endoftext|>"
# Document separators of common tokenizer families, tried in this order by eos_id().
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
MIN_VOCAB_SIZE = 256 + 1  # every byte plus the end-of-text token
TOKENIZER_FILE = "tokenizer.json"
_TRAIN_BATCH = 256


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid, or training parameters are wrong."""


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer (ByteLevel pre-tokenizer and decoder)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    it = iter(docs)
    while batch := list(islice(it, _TRAIN_BATCH)):
        yield batch


def train_tokenizer(docs: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE on ``docs`` and save it atomically as ``out``; return ``out``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN}), "
            f"got {vocab_size}"
        )
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(docs), trainer=trainer)
    out = Path(out)
    with atomic_file(out) as f:
        f.write(tok.to_str(pretty=True).encode())
    return out


def load_tokenizer(path: Path) -> Tokenizer:
    """Load any HF tokenizer.json (a directory means ``<dir>/tokenizer.json``)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found")
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not a tokenizer.json (invalid JSON: {exc})") from exc
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for schema errors
        raise TokenizerError(f"{path}: not a valid HF tokenizer file: {exc}") from exc


def eos_id(tok: Tokenizer, token: str | None = None) -> int:
    """Id of the document separator: ``token`` if given, else the first known EOS present."""
    candidates = (token,) if token else EOS_CANDIDATES
    for name in candidates:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise TokenizerError(f"tokenizer has no end-of-text token (looked for {', '.join(candidates)})")


def vocab_size(tok: Tokenizer) -> int:
    """One more than the largest token id, added tokens included."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1
