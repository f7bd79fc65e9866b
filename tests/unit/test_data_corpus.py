"""Embedded corpus and C4 shard reader."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossfed.data import corpus
from crossfed.data.corpus import (
    CorpusError,
    Document,
    cache_path,
    embedded_documents,
    iter_documents,
    iter_records,
    normalise,
    resolve_inputs,
    shard_name,
    write_embedded_corpus,
    write_shards,
)

SUBSET = 150  # documents: all language-reference topics plus some module docstrings


def write_c4(path: Path, lines: list[str]) -> Path:
    """Write raw lines as a C4 shard, gzipped when the name ends in .gz."""
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def record(text: str, url: str = "https://example.org/") -> str:
    return json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": url})


@pytest.fixture(scope="module")
def full_docs(tmp_path_factory: pytest.TempPathFactory) -> list[Document]:
    """The whole corpus generated here (an empty user cache), then read from its cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        assert not cache_path().exists()
        docs = embedded_documents()
        assert cache_path().is_file()
        mp.setattr(corpus, "_raw_documents", _not_generated)
        assert embedded_documents() == docs  # from the cache, not generated again
    return docs


def _not_generated() -> Iterator[Document]:
    raise AssertionError("the corpus was generated although its cache holds it")


@pytest.fixture
def small_generator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Document]:
    """An empty user cache under ``tmp_path`` and a generator of three documents."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    docs = [Document(f"python://test/{k}", f"text {k}") for k in range(3)]
    monkeypatch.setattr(corpus, "_raw_documents", lambda: iter(docs))
    return sorted(docs, key=corpus._url_key)


@pytest.fixture(scope="module")
def full_corpus(tmp_path_factory: pytest.TempPathFactory, full_docs: list[Document]) -> list[Path]:
    return write_shards(full_docs, tmp_path_factory.mktemp("corpus"), shards=4)


def test_full_corpus_is_several_megabytes_of_distinct_documents(full_corpus: list[Path]) -> None:
    assert [p.name for p in full_corpus] == [shard_name(k, 4) for k in range(4)]
    records = list(iter_records(full_corpus))
    texts = [r["text"] for r in records]
    assert sum(len(t.encode()) for t in texts) > 3_000_000
    assert len(texts) > 1000
    assert len({r["url"] for r in records}) == len(records)
    assert len(set(texts)) == len(texts)
    assert set(records[0]) == {"text", "timestamp", "url"}
    sources = {r["url"].split("/")[2] for r in records}
    assert {"pydoc_data", "stdlib"} <= sources
    assert any(r["url"].endswith("#comments") for r in records)
    assert all(t == normalise(t) and t for t in texts)


def test_shards_keep_document_order(full_corpus: list[Path], full_docs: list[Document]) -> None:
    assert list(iter_documents(full_corpus)) == [d.text for d in full_docs]
    urls = [r["url"] for r in iter_records(full_corpus)]
    assert urls == [d.url for d in full_docs]


def test_same_bytes_every_run_and_across_hash_seeds(tmp_path: Path) -> None:
    first = write_embedded_corpus(tmp_path / "a", shards=3, max_documents=SUBSET)
    second = write_embedded_corpus(tmp_path / "b", shards=3, max_documents=SUBSET)
    code = (
        "import sys; from pathlib import Path; from crossfed.data.corpus import "
        f"write_embedded_corpus as w; w(Path(sys.argv[1]), shards=3, max_documents={SUBSET})"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, env=env)
    for a, b in zip(first, second, strict=True):
        c = tmp_path / "c" / a.name
        assert a.read_bytes() == b.read_bytes() == c.read_bytes()
        assert a.read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime


def test_a_damaged_cache_is_generated_again_and_rewritten(
    small_generator: list[Document],
) -> None:
    for damage in ("", "{not json", '[["python://test/0"]]', "[]", '{"a": 1}', "[[1, 2]]"):
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        cache_path().write_text(damage)
        assert embedded_documents() == small_generator, damage
        rows = json.loads(cache_path().read_text())
        assert rows == [[d.url, d.text] for d in small_generator]


def test_a_cache_that_cannot_be_written_is_skipped(
    small_generator: list[Document], tmp_path: Path
) -> None:
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    assert embedded_documents() == small_generator
    assert embedded_documents() == small_generator


def test_the_cache_key_follows_every_stdlib_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "pkg").mkdir()
    listing = [(name, tmp_path / name) for name in ("a.py", "pkg/b.py")]
    for _, path in listing:
        path.write_text('"""doc"""\n')
    monkeypatch.setattr(corpus, "_stdlib_sources", lambda: iter(listing))
    first = cache_path()
    assert cache_path() == first
    listing[1][1].write_text('"""another doc"""\n')
    second = cache_path()
    assert second != first
    monkeypatch.setattr(corpus, "_stdlib_sources", lambda: iter(listing[:1]))
    assert cache_path() not in {first, second}


def test_subset_is_a_prefix_of_generation(tmp_path: Path) -> None:
    docs = embedded_documents(max_documents=20)
    assert len(docs) == 20
    assert all(d.url.startswith("python://pydoc_data/topics/") for d in docs)


def test_too_many_shards_for_documents(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="cannot split 3 documents into 5 shards"):
        write_embedded_corpus(tmp_path, shards=5, max_documents=3)


def test_normalise_whitespace() -> None:
    assert normalise("  a\r\nb \t\n\n\n\n\tc\u0065\u0301  \n") == "a\nb\n\n    c\u00e9"


def test_reads_real_c4_shards_in_every_format(tmp_path: Path) -> None:
    extra = json.dumps({"text": "ünïcödé 文字", "url": "u", "timestamp": "t", "extra": 1})
    a = write_c4(tmp_path / "c4-train.00000-of-00002.json.gz", [record("one"), "", record("two")])
    b = write_c4(tmp_path / "part.jsonl", [extra])
    c = write_c4(tmp_path / "part.jsonl.gz", [record("three")])
    assert list(iter_documents([a, b, c])) == ["one", "two", "ünïcödé 文字", "three"]


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    shard = write_c4(tmp_path / "bad.json.gz", [record("ok"), record("ok"), '{"text": "cut'])
    with pytest.raises(CorpusError, match=rf"{shard}:3: malformed JSON"):
        list(iter_documents([shard]))


def test_missing_text_names_file_and_line(tmp_path: Path) -> None:
    shard = write_c4(tmp_path / "notext.jsonl", [record("ok"), json.dumps({"url": "x"})])
    with pytest.raises(CorpusError, match=rf'{shard}:2: "text" field missing'):
        list(iter_documents([shard]))


def test_non_string_text_and_non_object_lines(tmp_path: Path) -> None:
    shard = write_c4(tmp_path / "num.jsonl", [json.dumps({"text": 5})])
    with pytest.raises(CorpusError, match=rf'{shard}:1: "text" field not a string'):
        list(iter_documents([shard]))
    shard = write_c4(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(CorpusError, match=rf"{shard}:1: expected one JSON object"):
        list(iter_documents([shard]))


def test_invalid_utf8_and_corrupt_gzip(tmp_path: Path) -> None:
    shard = tmp_path / "latin1.jsonl"
    shard.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=rf"{shard}:1: not UTF-8"):
        list(iter_documents([shard]))
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress((record("x") + "\n").encode() * 100)[:-30])
    with pytest.raises(CorpusError, match=rf"{broken}: corrupt gzip"):
        list(iter_documents([broken]))


def test_resolve_inputs_expands_directories(tmp_path: Path) -> None:
    d = tmp_path / "c4"
    d.mkdir()
    b = write_c4(d / "c4-train.00001-of-00002.json.gz", [record("b")])
    a = write_c4(d / "c4-train.00000-of-00002.json.gz", [record("a")])
    (d / "README.txt").write_text("not a shard")
    single = write_c4(tmp_path / "extra.jsonl", [record("c")])
    assert resolve_inputs([d, single, a]) == [a.resolve(), b.resolve(), single.resolve()]


def test_resolve_inputs_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no such file or directory"):
        resolve_inputs([tmp_path / "missing.json.gz"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="directory holds no shards"):
        resolve_inputs([tmp_path / "empty"])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CorpusError, match="not a shard file"):
        resolve_inputs([tmp_path / "notes.txt"])
    with pytest.raises(CorpusError, match="no input shards"):
        resolve_inputs([])
