"""Fixed windows in train.bin / val.bin and the WindowStore reader."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from crossfed.data.corpus import embedded_documents
from crossfed.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
from crossfed.data.windows import (
    FORMAT,
    WindowStore,
    WindowStoreError,
    dtype_for_vocab,
    val_window_count,
    write_meta,
    write_windows,
)


@dataclass
class _Encoding:
    ids: list[int]


class CharTokenizer:
    """One token per character, id = offset + code point (stands in for any HF tokenizer)."""

    def __init__(self, vocab: int, offset: int = 1) -> None:
        self.vocab, self.offset = vocab, offset

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {"<|endoftext|>": 0, "last": self.vocab - 1}

    def encode_batch(self, batch: list[str], add_special_tokens: bool = True) -> list[_Encoding]:
        return [_Encoding([self.offset + ord(c) for c in text]) for text in batch]


def stream_of(docs: list[str], tok: CharTokenizer, eos: int = 0) -> list[int]:
    out: list[int] = []
    for doc in docs:
        out += [tok.offset + ord(c) for c in doc] + [eos]
    return out


def store(tmp: Path, docs: list[str], tok: object, **kw: object) -> dict:
    kw.setdefault("seq_len", 7)
    kw.setdefault("eos", 0)
    meta = write_windows(docs, tok, tmp, **kw)
    write_meta(tmp, meta)
    return meta


DOCS = [f"document {i}: " + "abcdefghij"[: i % 10] * (i % 7 + 1) for i in range(60)]


@pytest.fixture(scope="module")
def real_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    texts = [d.text for d in embedded_documents(max_documents=30)]
    return load_tokenizer(train_tokenizer(texts, 300, tmp_path_factory.mktemp("t") / "tok.json"))


@pytest.mark.parametrize("seq_len", [1, 7, 31])
@pytest.mark.parametrize("batch_chars", [1, 50, 1 << 20])
def test_windows_are_the_token_stream(tmp_path: Path, seq_len: int, batch_chars: int) -> None:
    tok = CharTokenizer(128)
    meta = store(tmp_path, DOCS, tok, seq_len=seq_len, val_fraction=0.1, batch_chars=batch_chars)
    stream = stream_of(DOCS, tok)
    window = seq_len + 1
    n_total = len(stream) // window
    assert meta["n_windows"] + meta["n_val_windows"] == n_total
    assert meta["n_val_windows"] == max(1, int(n_total * 0.1))
    assert meta["n_tokens"] == len(stream)
    assert meta["n_tokens_dropped"] == len(stream) - n_total * window
    assert meta["n_documents"] == len(DOCS)
    train, val = WindowStore.open(tmp_path), WindowStore.open(tmp_path, "val")
    both = np.concatenate([train.windows(0, train.n_windows), val.windows(0, val.n_windows)])
    expected = np.array(stream[: n_total * window]).reshape(n_total, window)
    np.testing.assert_array_equal(both, expected)
    assert train.window_len == window and train.vocab_size == 128


def test_val_is_the_held_out_tail_never_in_train(tmp_path: Path) -> None:
    docs = [f"unique {i:04d} " for i in range(400)]
    tok = CharTokenizer(128)
    store(tmp_path, docs, tok, seq_len=15, val_fraction=0.05)
    train = WindowStore.open(tmp_path).windows(0, WindowStore.open(tmp_path).n_windows)
    val_store = WindowStore.open(tmp_path, "val")
    val = val_store.windows(0, val_store.n_windows)
    assert val_store.n_windows == int((train.shape[0] + val.shape[0]) * 0.05)
    train_rows = {row.tobytes() for row in train}
    assert not any(row.tobytes() in train_rows for row in val)
    assert train.shape[0] == WindowStore.open(tmp_path).n_windows  # train block space excludes val


def test_real_tokenizer_windows(tmp_path: Path, real_tok: Tokenizer) -> None:
    docs = [d.text for d in embedded_documents(max_documents=12)]
    eos = eos_id(real_tok)
    meta = store(tmp_path, docs, real_tok, seq_len=63, eos=eos, val_fraction=0.05)
    stream = []
    for doc in docs:
        stream += real_tok.encode(doc, add_special_tokens=False).ids + [eos]
    n_total = len(stream) // 64
    train = WindowStore.open(tmp_path)
    assert meta["dtype"] == "uint16" and train.n_windows + meta["n_val_windows"] == n_total
    np.testing.assert_array_equal(train.windows(0, 3).ravel(), stream[: 3 * 64])
    assert real_tok.decode(train.windows(0, 1)[0].tolist()) in "".join(docs)


def test_dtype_choice() -> None:
    assert dtype_for_vocab(300) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(151_936) == "uint32"


def test_large_vocab_uses_uint32(tmp_path: Path) -> None:
    tok = CharTokenizer(200_000, offset=70_000)
    meta = store(tmp_path, DOCS, tok, seq_len=7, val_fraction=0.1)
    assert meta["dtype"] == "uint32"
    w = WindowStore.open(tmp_path)
    assert (tmp_path / "train.bin").stat().st_size == w.n_windows * 8 * 4
    np.testing.assert_array_equal(w.windows(0, 1)[0], stream_of(DOCS, tok)[:8])
    assert w.windows(0, 1).max() >= 70_000


def test_take_and_range_reads(tmp_path: Path) -> None:
    store(tmp_path, DOCS, CharTokenizer(128), seq_len=7, val_fraction=0.1)
    w = WindowStore.open(tmp_path)
    all_rows = w.windows(0, w.n_windows)
    assert all_rows.dtype == np.int64 and all_rows.shape == (w.n_windows, 8)
    idx = np.array([5, 0, w.n_windows - 1, 5])
    np.testing.assert_array_equal(w.take(idx), all_rows[idx])
    assert w.windows(3, 3).shape == (0, 8)
    rows = w.windows(0, 2)
    rows[:] = -1  # a copy: the memmap is untouched
    assert w.windows(0, 1).min() >= 0
    with pytest.raises(WindowStoreError, match="outside"):
        w.windows(0, w.n_windows + 1)
    with pytest.raises(WindowStoreError, match="out of range"):
        w.take(np.array([w.n_windows]))
    with pytest.raises(WindowStoreError, match="out of range"):
        w.take(np.array([-1]))
    with pytest.raises(WindowStoreError, match="1-D integer"):
        w.take(np.array([0.5]))


def test_val_window_count() -> None:
    assert val_window_count(100, 0.05) == 5
    assert val_window_count(10, 0.05) == 1
    assert val_window_count(10, 0.0) == 0
    with pytest.raises(WindowStoreError, match="val_fraction"):
        val_window_count(10, 1.0)


def test_no_val_split(tmp_path: Path) -> None:
    meta = store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.0)
    assert meta["n_val_windows"] == 0 and (tmp_path / "val.bin").stat().st_size == 0
    with pytest.raises(WindowStoreError, match="val split has no windows"):
        WindowStore.open(tmp_path, "val")


def test_too_small_corpus_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(WindowStoreError, match="corpus too small"):
        write_windows(["ab"], CharTokenizer(128), tmp_path, seq_len=7, eos=0)
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_keeps_previous_files(tmp_path: Path) -> None:
    store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.1)
    before = (tmp_path / "train.bin").read_bytes()

    def broken():
        yield from DOCS[:10]
        raise RuntimeError("source vanished")

    with pytest.raises(RuntimeError, match="source vanished"):
        write_windows(broken(), CharTokenizer(128), tmp_path, seq_len=3, eos=0, batch_chars=1)
    assert (tmp_path / "train.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_truncated_bin_is_rejected(tmp_path: Path) -> None:
    store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.1)
    path = tmp_path / "train.bin"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(WindowStoreError, match="truncated or stale"):
        WindowStore.open(tmp_path)


def test_verify_detects_a_changed_byte(tmp_path: Path) -> None:
    store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.1)
    WindowStore.open(tmp_path).verify()
    WindowStore.open(tmp_path, "val").verify()
    data = bytearray((tmp_path / "val.bin").read_bytes())
    data[0] ^= 1
    (tmp_path / "val.bin").write_bytes(bytes(data))
    with pytest.raises(WindowStoreError, match="sha256"):
        WindowStore.open(tmp_path, "val").verify()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other-v9"}, "format is 'other-v9'"),
        ({"window_len": 9}, "window_len 9 != seq_len 7 \\+ 1"),
        ({"dtype": "float32"}, "dtype 'float32' not one of"),
        ({"n_windows": -1}, "n_windows must be a non-negative integer"),
        ({"n_windows": 10_000}, "truncated or stale"),
        ({"eos_id": None}, "missing field\\(s\\) eos_id"),
    ],
)
def test_wrong_meta_is_rejected(tmp_path: Path, change: dict, message: str) -> None:
    meta = store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.1)
    meta.update(change)
    meta = {k: v for k, v in meta.items() if v is not None}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(WindowStoreError, match=message):
        WindowStore.open(tmp_path)


def test_missing_or_broken_meta_and_unknown_split(tmp_path: Path) -> None:
    with pytest.raises(WindowStoreError, match="meta.json: not found"):
        WindowStore.open(tmp_path)
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(WindowStoreError, match="invalid JSON"):
        WindowStore.open(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": FORMAT}))
    with pytest.raises(WindowStoreError, match="missing field"):
        WindowStore.open(tmp_path)
    with pytest.raises(WindowStoreError, match="unknown split 'test'"):
        WindowStore.open(tmp_path, "test")


def test_missing_bin_file(tmp_path: Path) -> None:
    store(tmp_path, DOCS, CharTokenizer(128), val_fraction=0.1)
    (tmp_path / "train.bin").unlink()
    with pytest.raises(WindowStoreError, match="train.bin: not found"):
        WindowStore.open(tmp_path)


def test_bad_arguments(tmp_path: Path) -> None:
    tok = CharTokenizer(128)
    with pytest.raises(WindowStoreError, match="seq_len must be at least 1"):
        write_windows(DOCS, tok, tmp_path, seq_len=0, eos=0)
    with pytest.raises(WindowStoreError, match="eos id 500 outside"):
        write_windows(DOCS, tok, tmp_path, seq_len=4, eos=500)
    with pytest.raises(WindowStoreError, match="token id 200 >= vocab size 128"):
        write_windows(["\x7f" * 20], CharTokenizer(128, offset=73), tmp_path, seq_len=4, eos=0)
