"""Text corpora in C4 shard format: the embedded Python-documentation corpus and the reader.

The embedded corpus is English text that ships with CPython itself, so a run can be prepared
on a machine without network access:

* the language-reference topics of ``pydoc_data.topics``;
* docstrings of built-in and extension modules from a fixed list (``inspect.getdoc``);
* docstrings of the pure-Python standard library, read from its source with ``ast``
  (no imports, so no side effects), one document per module;
* comment blocks of the same source files, one document per module.

Every docstring and comment block is kept once (first occurrence wins), whitespace is
normalised and documents are ordered by the SHA-256 of their URL, so every run on the same
Python build yields the same bytes and the held-out tail is a mix of all sources.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import sysconfig
import unicodedata
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from types import ModuleType
from typing import IO

import platformdirs

from crossfed.fileio import atomic_file, write_atomic

SHARD_PATTERNS = ("*.json.gz", "*.jsonl.gz", "*.jsonl", "*.json")
EMBEDDED_TIMESTAMP = "2019-04-18T00:00:00Z"  # constant, so shard bytes never depend on a clock

# Built-in and extension modules: their docstrings live in C, not in any .py file.
C_MODULES = (
    "builtins",
    "sys",
    "gc",
    "marshal",
    "time",
    "math",
    "cmath",
    "itertools",
    "errno",
    "posix",
    "array",
    "binascii",
    "select",
    "mmap",
    "zlib",
    "unicodedata",
    "fcntl",
    "grp",
    "pwd",
    "resource",
    "termios",
    "syslog",
    "atexit",
    "faulthandler",
    "pyexpat",
    "_io",
    "_collections",
    "_functools",
    "_operator",
    "_thread",
    "_datetime",
    "_heapq",
    "_bisect",
    "_random",
    "_struct",
    "_socket",
    "_ssl",
    "_sqlite3",
    "_csv",
    "_pickle",
    "_sre",
    "_string",
    "_weakref",
    "_abc",
    "_codecs",
    "_signal",
    "_stat",
    "_contextvars",
    "_asyncio",
    "_json",
    "_hashlib",
    "_blake2",
    "_bz2",
    "_lzma",
    "_elementtree",
    "_decimal",
)

# Source trees left out: test suites, third-party packages, generated codec tables.
_SKIP_PARTS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
)
_MIN_COMMENT_CHARS = 40
_MIN_COMMENT_LETTER_SHARE = 0.6


class CorpusError(ValueError):
    """A corpus shard is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Document:
    """One corpus document with its C4-style URL."""

    url: str
    text: str


# --------------------------------------------------------------------------- normalisation

_TRAILING_WS = re.compile(r"[ \t\f\v]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalise(text: str) -> str:
    """NFC, Unix newlines, tabs as spaces, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    text = _TRAILING_WS.sub("", text)
    return _BLANK_RUNS.sub("\n\n", text).strip()


# --------------------------------------------------------------------------- embedded sources


def _topic_documents() -> Iterator[Document]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield Document(f"python://pydoc_data/topics/{name}", topics[name])


def _own_member(module: ModuleType, name: str, value: object) -> object | None:
    """``value`` if the C module itself defines it, else None (runtime patches are ignored).

    Hooks that a process may replace (``sys.excepthook``, ...) are read from their pristine
    ``__name__`` copies, so the corpus does not depend on who imported what.
    """
    value = getattr(module, f"__{name}__", value)
    if inspect.isbuiltin(value):
        return value if getattr(value, "__self__", None) is module else None
    if inspect.isclass(value):
        return value if value.__module__ in (module.__name__, module.__name__.lstrip("_")) else None
    return None


def _c_member_docs(obj: object, qual: str, depth: int) -> Iterator[tuple[str, str]]:
    doc = inspect.getdoc(obj)
    if doc:
        yield qual, doc
    if depth >= 2:
        return
    try:
        members = sorted(vars(obj).items())
    except TypeError:
        return
    for name, value in members:
        if name.startswith("_"):
            continue
        if isinstance(obj, ModuleType):
            value = _own_member(obj, name, value)
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isclass(value) or inspect.isroutine(value) or isinstance(value, property):
            yield from _c_member_docs(value, f"{qual}.{name}", depth + 1)


def _c_module_documents() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    for name in C_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue  # optional extension not built on this interpreter
        yield f"python://stdlib/{name}", list(_c_member_docs(module, name, 0))


def _stdlib_sources() -> Iterator[tuple[str, Path]]:
    """The standard library's ``.py`` files, ``(path relative to its root, path)``, sorted;
    the trees of ``_SKIP_PARTS`` and ``config-*`` are never entered."""
    root = Path(sysconfig.get_path("stdlib"))
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        top = here == root
        dirs[:] = [
            d for d in dirs if d not in _SKIP_PARTS and not (top and d.startswith("config-"))
        ]
        found += [
            ((here / f).relative_to(root).as_posix(), here / f)
            for f in files
            if f.endswith(".py") and not (top and f.startswith("config-"))
        ]
    return iter(sorted(found))


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ast_docs(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    def visit(node: ast.AST, qual: str) -> Iterator[tuple[str, str]]:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc:
            yield qual, doc
        for child in node.body:  # type: ignore[attr-defined]
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                yield from visit(child, f"{qual}.{child.name}")

    yield from visit(tree, module)


def _comment_blocks(source: str) -> Iterator[str]:
    block: list[str] = []
    for line in source.splitlines() + [""]:
        stripped = line.lstrip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            body = stripped[1:]
            block.append(body[1:] if body.startswith(" ") else body)
            continue
        text = "\n".join(block).strip()
        block = []
        if len(text) < _MIN_COMMENT_CHARS or "-*-" in text:
            continue
        letters = sum(ch.isalpha() or ch == " " for ch in text)
        if letters / len(text) >= _MIN_COMMENT_LETTER_SHARE:
            yield text


def _source_documents() -> Iterator[tuple[str, list[tuple[str, str]], list[str]]]:
    for rel, path in _stdlib_sources():
        data = path.read_bytes()
        try:
            tree = ast.parse(data, filename=rel)
            source = data.decode("utf-8")
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        module = _module_name(rel)
        yield rel, list(_ast_docs(tree, module)), list(_comment_blocks(source))


def _raw_documents() -> Iterator[Document]:
    """All embedded documents in generation order, each docstring/comment kept once."""
    seen: set[str] = set()

    def fresh(items: Iterable[tuple[str, str]]) -> str:
        parts = []
        for qual, doc in items:
            doc = normalise(doc)
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(f"{qual}\n\n{doc}")
        return "\n\n".join(parts)

    for doc in _topic_documents():
        text = normalise(doc.text)
        if text and text not in seen:
            seen.add(text)
            yield Document(doc.url, text)
    for url, items in _c_module_documents():
        if text := fresh(items):
            yield Document(url, text)
    for rel, docstrings, comments in _source_documents():
        if text := fresh(docstrings):
            yield Document(f"python://stdlib/{rel}", text)
        blocks = []
        for block in map(normalise, comments):
            if block and block not in seen:
                seen.add(block)
                blocks.append(block)
        if blocks:
            yield Document(f"python://stdlib/{rel}#comments", "\n\n".join(blocks))


def _url_key(doc: Document) -> str:
    return hashlib.sha256(doc.url.encode()).hexdigest()


def embedded_documents(max_documents: int | None = None) -> list[Document]:
    """The embedded corpus in its deterministic order (first ``max_documents`` generated).

    The whole corpus is read from the user's cache when this Python's standard library and
    this module are those it was generated from (:func:`cache_path`), else generated (some
    seconds: every stdlib file is parsed) and cached; a cache that cannot be read or written
    is regenerated or skipped, never an error."""
    if max_documents is not None:
        return sorted(islice(_raw_documents(), max_documents), key=_url_key)
    cache = cache_path()
    if (docs := _read_cache(cache)) is not None:
        return docs
    docs = sorted(_raw_documents(), key=_url_key)
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps([[d.url, d.text] for d in docs], ensure_ascii=False))
    return docs


def cache_path() -> Path:
    """Where the generated corpus of this Python and this version of crossfed is cached:
    ``<user cache>/crossfed/embedded-corpus/<key>.json`` (``$XDG_CACHE_HOME``, else
    ``~/.cache``, on Linux). The key digests what the corpus is made of: this module's
    source, the interpreter's version and the name, size and mtime of every stdlib file read."""
    root = Path(sysconfig.get_path("stdlib"))
    files = [(rel, path.stat()) for rel, path in _stdlib_sources()]
    made_of = {
        "generator": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "python": [sys.version, sys.platform, str(root)],
        "files": [[rel, st.st_size, st.st_mtime_ns] for rel, st in files],
    }
    key = hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:32]
    return Path(platformdirs.user_cache_dir("crossfed")) / "embedded-corpus" / f"{key}.json"


def _read_cache(path: Path) -> list[Document] | None:
    """The documents cached at ``path``; None if it is missing or not a cache's content."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        docs = [Document(url, text) for url, text in rows]
    except (OSError, ValueError, TypeError):
        return None
    ok = all(isinstance(d.url, str) and isinstance(d.text, str) for d in docs)
    return docs if ok and docs else None


def shard_name(index: int, shards: int) -> str:
    """C4 file name of shard ``index`` of ``shards``."""
    return f"c4-train.{index:05d}-of-{shards:05d}.json.gz"


def _c4_line(doc: Document) -> bytes:
    record = {"text": doc.text, "timestamp": EMBEDDED_TIMESTAMP, "url": doc.url}
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def write_shards(docs: Sequence[Document], out_dir: Path, shards: int) -> list[Path]:
    """Write ``docs`` as ``shards`` contiguous C4 .json.gz shards (gzip mtime 0, no name)."""
    if shards < 1:
        raise CorpusError(f"shards must be at least 1, got {shards}")
    if len(docs) < shards:
        raise CorpusError(f"cannot split {len(docs)} documents into {shards} shards")
    out_dir = Path(out_dir)
    paths = []
    for k in range(shards):
        lo, hi = k * len(docs) // shards, (k + 1) * len(docs) // shards
        path = out_dir / shard_name(k, shards)
        with atomic_file(path) as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                for doc in docs[lo:hi]:
                    gz.write(_c4_line(doc))
        paths.append(path)
    return paths


def write_embedded_corpus(
    out_dir: Path, shards: int = 4, *, max_documents: int | None = None
) -> list[Path]:
    """Write the embedded corpus as C4 shards into ``out_dir``; return the shard paths."""
    return write_shards(embedded_documents(max_documents), Path(out_dir), shards)


# --------------------------------------------------------------------------- reading shards


def is_shard(path: Path) -> bool:
    """Whether ``path`` has a C4 shard suffix (.json.gz, .jsonl.gz, .jsonl, .json)."""
    return path.name.endswith((".json.gz", ".jsonl.gz", ".jsonl", ".json"))


def resolve_inputs(paths: Sequence[Path]) -> list[Path]:
    """Expand files and directories into a sorted, de-duplicated list of shard files."""
    found: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            inside = sorted(p for p in given.iterdir() if p.is_file() and is_shard(p))
            if not inside:
                raise CorpusError(
                    f"{given}: directory holds no shards ({', '.join(SHARD_PATTERNS)})"
                )
            found.extend(inside)
        elif given.is_file():
            if not is_shard(given):
                raise CorpusError(f"{given}: not a shard file ({', '.join(SHARD_PATTERNS)})")
            found.append(given)
        else:
            raise CorpusError(f"{given}: no such file or directory")
    unique = list(dict.fromkeys(p.resolve() for p in found))
    if not unique:
        raise CorpusError("no input shards given")
    return unique


def _open_lines(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _numbered_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line of one shard."""
    try:
        stream = _open_lines(path)
    except OSError as exc:
        raise CorpusError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    lineno = 0
    with stream:
        try:
            for lineno, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not UTF-8: {exc.reason}") from exc
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: malformed JSON: {exc.msg}") from exc
                if not isinstance(record, dict):
                    raise CorpusError(f"{path}:{lineno}: expected one JSON object per line")
                yield lineno, record
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise CorpusError(f"{path}: corrupt gzip data after line {lineno}: {exc}") from exc


def iter_records(paths: Sequence[Path]) -> Iterator[dict]:
    """Yield every JSON object of the given C4 shards, in order; errors name file:line."""
    for path in map(Path, paths):
        for _, record in _numbered_records(path):
            yield record


def iter_documents(paths: Sequence[Path]) -> Iterator[str]:
    """Yield the ``text`` of every record in the given C4 shards, in order."""
    for path in map(Path, paths):
        for lineno, record in _numbered_records(path):
            text = record.get("text")
            if not isinstance(text, str):
                what = "missing" if text is None else f"not a string ({type(text).__name__})"
                raise CorpusError(f'{path}:{lineno}: "text" field {what}')
            yield text
