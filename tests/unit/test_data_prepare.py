"""`crossfed data prepare`: end to end on small corpora."""

from __future__ import annotations

import argparse
import functools
import gzip
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crossfed.data import prepare as prepare_mod
from crossfed.data.commands import add_parser
from crossfed.data.corpus import embedded_documents, iter_documents, write_embedded_corpus
from crossfed.data.prepare import PrepareError, prepare
from crossfed.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
from crossfed.data.windows import WindowStore

SMALL = dict(vocab_size=300, seq_len=16, val_fraction=0.05)
REQUIRED = {
    "format",
    "seq_len",
    "window_len",
    "dtype",
    "vocab_size",
    "eos_id",
    "n_windows",
    "n_val_windows",
    "sha256",
    "tokenizer_sha256",
    "source",
    "created_by",
}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [d.text for d in embedded_documents(max_documents=40)]


@pytest.fixture
def shards(tmp_path: Path, texts: list[str]) -> list[Path]:
    """Two user C4 shards in different formats."""
    d = tmp_path / "c4"
    d.mkdir()
    half = len(texts) // 2
    a = d / "c4-train.00000-of-00002.json.gz"
    a.write_bytes(gzip.compress("".join(_line(t) for t in texts[:half]).encode(), mtime=0))
    b = d / "c4-train.00001-of-00002.jsonl"
    b.write_text("".join(_line(t) for t in texts[half:]), encoding="utf-8")
    return [a, b]


def _line(text: str) -> str:
    return json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "u"}) + "\n"


def mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def collect(lines: list[str]) -> Callable[[str], None]:
    return lines.append


def test_prepare_inputs_and_idempotency(tmp_path: Path, shards: list[Path]) -> None:
    out, log = tmp_path / "out", []
    meta = prepare(
        out, inputs=[shards[0].parent], tokenizer=None, shards=4, log=collect(log), **SMALL
    )
    assert REQUIRED <= set(meta)
    assert meta["created_by"] == "crossfed data prepare"
    assert meta["source"] == [p.name for p in shards]
    assert meta["vocab_size"] == 300 and meta["window_len"] == 17
    assert json.loads((out / "meta.json").read_text()) == meta
    assert any(line.startswith("windows:") for line in log)
    assert not (out / "corpus").exists()  # user shards are read in place

    tok = load_tokenizer(out / "tokenizer.json")
    stream = []
    for doc in iter_documents(shards):
        stream += tok.encode(doc, add_special_tokens=False).ids + [eos_id(tok)]
    n_total = len(stream) // 17
    train = WindowStore.open(out)
    assert train.n_windows + meta["n_val_windows"] == n_total
    np.testing.assert_array_equal(
        train.windows(0, train.n_windows).ravel(), stream[: 17 * train.n_windows]
    )

    before, log2 = mtimes(out), []
    again = prepare(
        out, inputs=[shards[0].parent], tokenizer=None, shards=4, log=collect(log2), **SMALL
    )
    assert again == meta
    assert mtimes(out) == before
    assert len(log2) == 1 and "up to date" in log2[0]


def test_changed_parameters_or_inputs_rebuild(tmp_path: Path, shards: list[Path]) -> None:
    out = tmp_path / "out"
    first = prepare(out, inputs=shards, tokenizer=None, shards=4, log=collect([]), **SMALL)
    longer = prepare(
        out, inputs=shards, tokenizer=None, shards=4, log=collect([]), **{**SMALL, "seq_len": 32}
    )
    assert longer["window_len"] == 33 and longer["n_windows"] < first["n_windows"]

    with shards[1].open("a", encoding="utf-8") as f:
        f.write(_line("one more document " * 50))
    log = []
    grown = prepare(
        out, inputs=shards, tokenizer=None, shards=4, log=collect(log), **{**SMALL, "seq_len": 32}
    )
    assert not any("up to date" in line for line in log)
    assert grown["source_sha256"] != longer["source_sha256"]
    assert grown["n_tokens"] > longer["n_tokens"]

    log = []
    prepare(
        out,
        inputs=shards,
        tokenizer=None,
        shards=4,
        force=True,
        log=collect(log),
        **{**SMALL, "seq_len": 32},
    )
    assert not any("up to date" in line for line in log)


def test_damaged_output_is_rebuilt(tmp_path: Path, shards: list[Path]) -> None:
    out = tmp_path / "out"
    meta = prepare(out, inputs=shards, tokenizer=None, shards=4, log=collect([]), **SMALL)
    (out / "train.bin").write_bytes(b"")
    log = []
    again = prepare(out, inputs=shards, tokenizer=None, shards=4, log=collect(log), **SMALL)
    assert again == meta
    assert WindowStore.open(out).n_windows == meta["n_windows"]


def test_user_tokenizer_is_used_as_is(tmp_path: Path, shards: list[Path], texts: list[str]) -> None:
    user = train_tokenizer(texts[:10], 280, tmp_path / "user" / "tokenizer.json")
    out = tmp_path / "out"
    meta = prepare(
        out,
        inputs=shards,
        tokenizer=user,
        vocab_size=4096,
        seq_len=16,
        val_fraction=0.05,
        shards=4,
        log=collect([]),
    )
    assert (out / "tokenizer.json").read_bytes() == user.read_bytes()
    assert meta["vocab_size"] == 280
    assert meta["params"]["tokenizer"] == "given"
    tok = load_tokenizer(user)
    first = tok.encode(next(iter_documents(shards)), add_special_tokens=False).ids
    np.testing.assert_array_equal(WindowStore.open(out).windows(0, 1)[0], first[:17])

    log = []
    prepare(
        out,
        inputs=shards,
        tokenizer=user.parent,
        vocab_size=4096,
        seq_len=16,
        val_fraction=0.05,
        shards=4,
        log=collect(log),
    )
    assert "up to date" in log[0]


def test_embedded_corpus_when_no_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = functools.partial(write_embedded_corpus, max_documents=60)
    monkeypatch.setattr(prepare_mod, "write_embedded_corpus", small)
    out = tmp_path / "out"
    meta = prepare(out, inputs=None, tokenizer=None, shards=3, log=collect([]), **SMALL)
    corpus = sorted((out / "corpus").iterdir())
    assert (
        [p.name for p in corpus]
        == meta["source"]
        == [f"c4-train.0000{k}-of-00003.json.gz" for k in range(3)]
    )
    assert meta["params"]["corpus"] == "embedded" and meta["n_documents"] == 60

    log = []
    assert prepare(out, inputs=None, tokenizer=None, shards=3, log=collect(log), **SMALL) == meta
    assert "up to date" in log[0]

    prepare(out, inputs=None, tokenizer=None, shards=2, log=collect([]), **SMALL)
    assert sorted(p.name for p in (out / "corpus").iterdir()) == [
        f"c4-train.0000{k}-of-00002.json.gz" for k in range(2)
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 0}, "--seq-len"),
        ({"vocab_size": 100}, "--vocab-size"),
        ({"val_fraction": 1.5}, "--val-fraction"),
        ({"shards": 0}, "--shards"),
    ],
)
def test_bad_parameters(tmp_path: Path, change: dict, message: str) -> None:
    kw = {**SMALL, "shards": 4, **change}
    with pytest.raises(PrepareError, match=message):
        prepare(tmp_path, inputs=None, tokenizer=None, log=collect([]), **kw)
    assert list(tmp_path.iterdir()) == []


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="crossfed data")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli(tmp_path: Path, shards: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = ["prepare", "--out", str(out), "--vocab-size", "300", "--seq-len", "16"]
    argv += ["--input", str(shards[0]), "--input", str(shards[1])]
    assert _cli(argv) == 0
    printed = capsys.readouterr().out
    assert "windows:" in printed and "prepare: wrote" in printed
    assert json.loads((out / "meta.json").read_text())["source"] == [p.name for p in shards]

    assert _cli(argv) == 0
    assert "up to date" in capsys.readouterr().out


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    assert (
        _cli(["prepare", "--out", str(tmp_path / "o"), "--input", str(bad), "--vocab-size", "300"])
        == 1
    )
    err = capsys.readouterr().err
    assert f'{bad}:2: "text" field missing' in err

    assert (
        _cli(["prepare", "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "none.json")])
        == 1
    )
    assert "tokenizer file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_full_embedded_prepare(tmp_path: Path) -> None:
    meta = prepare(
        tmp_path,
        inputs=None,
        tokenizer=None,
        vocab_size=4096,
        seq_len=128,
        val_fraction=0.05,
        shards=4,
        log=collect([]),
    )
    assert meta["n_tokens"] > 500_000
    assert meta["n_windows"] + meta["n_val_windows"] == meta["n_tokens"] // 129
    WindowStore.open(tmp_path).verify()
