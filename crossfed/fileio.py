"""Files on disk, without torch: atomic writes, durable renames, the run folder's kept models.

Every file crossfed writes whole appears atomically, one way: a temp file beside the target
with a unique hidden name (``.<name>.<random>.tmp``; the coordinator's retention removes
those a killed write leaves among its models), written, flushed and fsynced, renamed over
the target, and the folder fsynced so the rename survives a crash. :func:`write_atomic`
does it for bytes or text in memory, :func:`atomic_file` for a file written as a stream;
writers that fill a temp file their own way (ranged downloads, blob uploads, several files
put in place together) take its name from :func:`temp_beside` or
:func:`create_temp_beside` and finish with :func:`replace_durably`.

The wire format (safetensors streaming, digests, delta codecs) is :mod:`crossfed.wire`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: default inline/blob threshold: the paper's 2 GiB message cap (``transport.inline_max_bytes``)
INLINE_MAX_BYTES = 2 * 1024**3


def create_temp_beside(path: Path, suffix: str = ".tmp", mode: int = 0o666) -> tuple[int, Path]:
    """Create an empty hidden temp file next to ``path`` with a name no other writer has
    (``.<name>.<random><suffix>``, ``mode`` less the umask); returns its open fd and path.
    The fd reads too, so a file can be read back (``pread``) while it is being written."""
    path = Path(path)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{suffix}"
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def temp_beside(path: Path) -> Iterator[Path]:
    """The name of a fresh temp file next to ``path``, removed when the block ends unless it
    was put in place (:func:`replace_durably`) by then."""
    fd, tmp = create_temp_beside(path)
    os.close(fd)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a rename inside folder ``path`` durable (a no-op where folders cannot be opened
    or the filesystem cannot sync one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path, *, fsync: bool = True) -> None:
    """Put the finished (and, by its writer, fsynced) ``tmp`` in place as ``path``: rename,
    then fsync the folder."""
    os.replace(tmp, path)
    if fsync:
        fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_file(
    path: Path, *, fsync: bool = True, mode: int = 0o666, buffering: int = -1
) -> Iterator[BinaryIO]:
    """A binary file handle on a temp file beside ``path``; when the block ends normally it
    is flushed, fsynced and renamed into place (and the folder fsynced). An exception leaves
    ``path`` as it was and no temp file behind. ``fsync=False`` skips both fsyncs (the file
    is still whole or absent for readers, but may not survive a machine crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_beside(path, mode=mode)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as handle:
            yield handle
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        replace_durably(tmp, path, fsync=fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(
    path: Path | str, data: str | bytes, *, fsync: bool = True, mode: int = 0o666
) -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically: readers see the old
    file or the new one, never a part. Returns ``path`` as a :class:`~pathlib.Path`."""
    path = Path(path)
    if isinstance(data, str):
        raw: bytes | bytearray | memoryview = data.encode()
    elif isinstance(data, bytes | bytearray | memoryview):
        raw = data
    else:
        raise TypeError(f"write_atomic writes str or bytes, not {type(data).__name__}")
    with atomic_file(path, fsync=fsync, mode=mode, buffering=0) as handle:
        view = memoryview(raw)
        while view:
            view = view[handle.write(view) :]
    return path


def kept_model_path(results: Path, generation: int) -> Path:
    """Where a run folder keeps generation ``generation``'s global model, no rule's output.

    The coordinator keeps only its last few generations; the workflow's checkpoint under
    ``results/checkpoints`` is a hard link to this copy, so a rerun that deleted the
    checkpoint finds the model here again.
    """
    return Path(results) / ".crossfed" / "models" / f"global-{generation}.safetensors"


def link_or_copy(source: Path, dest: Path) -> None:
    """``dest`` as a hard link to ``source`` (a copy across filesystems), put in place as
    every file is (a temp name beside it, a durable rename)."""
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    with temp_beside(dest) as tmp:
        tmp.unlink()  # the name is ours alone; the link takes it
        try:
            os.link(source, tmp)
        except OSError:  # another filesystem: a copy, fsynced
            with open(source, "rb") as src, atomic_file(dest) as out:
                shutil.copyfileobj(src, out, 16 << 20)
            return
        replace_durably(tmp, dest)


def keep_global_model(downloaded: Path, results: Path, generation: int) -> None:
    """Keep a global model a site loop downloaded as the run folder's copy (if it has none).

    A site loop trains the rounds back to back and may run rounds ahead of the workflow's
    merge jobs, which secure each round's model; this copy spares them a download the
    coordinator may no longer serve.
    """
    kept = kept_model_path(results, generation)
    if not kept.exists():
        link_or_copy(downloaded, kept)
