"""crossfed.fileio's one way to write a file atomically, on real files in a temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crossfed.fileio import (
    atomic_file,
    create_temp_beside,
    replace_durably,
    temp_beside,
    write_atomic,
)


def _others(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


@pytest.mark.parametrize("fsync", [True, False])
def test_write_atomic_writes_text_and_bytes_over_the_old_file_and_leaves_nothing_else(
    tmp_path: Path, fsync: bool
) -> None:
    path = tmp_path / "sub" / "plan.json"
    assert write_atomic(path, '{"round": 1}\n', fsync=fsync) == path  # the folder is made
    assert path.read_text() == '{"round": 1}\n'
    write_atomic(str(path), b"\x00\xffbytes", fsync=fsync)
    assert path.read_bytes() == b"\x00\xffbytes"
    write_atomic(path, "é", fsync=fsync)  # text is UTF-8
    assert path.read_bytes() == "é".encode()
    assert _others(path.parent, path.name) == []


def test_a_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "outcome.json"
    write_atomic(path, "old\n")
    with pytest.raises(RuntimeError, match="disk full"), atomic_file(path) as handle:
        handle.write(b"half of the new")
        raise RuntimeError("disk full")
    assert path.read_text() == "old\n" and _others(tmp_path, path.name) == []
    with pytest.raises(TypeError):
        write_atomic(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old\n" and _others(tmp_path, path.name) == []


def test_the_temp_file_is_hidden_beside_the_target_with_a_name_of_its_own(tmp_path: Path) -> None:
    """``.<name>.<random>.tmp``: the coordinator's retention removes such leftovers of a
    killed write; two writers of one file never share a temp file."""
    path = tmp_path / "global-3.safetensors"
    with atomic_file(path) as handle, atomic_file(path) as other:
        handle.write(b"first")
        other.write(b"second")
        temps = _others(tmp_path, path.name)
        assert len(temps) == 2 and not path.exists()
        for name in temps:
            assert name.startswith(f".{path.name}.") and name.endswith(".tmp")
    assert path.read_bytes() == b"first"  # the outer block ended last
    assert _others(tmp_path, path.name) == []
    fd, part = create_temp_beside(path, suffix=".part", mode=0o644)
    os.close(fd)
    assert part.parent == tmp_path and part.name.endswith(".part")


def test_mode_is_the_new_files_from_its_first_byte(tmp_path: Path) -> None:
    secret = write_atomic(tmp_path / "secrets.yaml", "admin: x\n", mode=0o600)
    assert secret.stat().st_mode & 0o777 == 0o600
    umask = os.umask(0o022)
    os.umask(umask)
    plain = write_atomic(tmp_path / "plain.json", "{}")
    assert plain.stat().st_mode & 0o777 == 0o666 & ~umask


def test_temp_beside_removes_its_file_unless_it_was_put_in_place(tmp_path: Path) -> None:
    target = tmp_path / "train.bin"
    with temp_beside(target) as tmp:
        tmp.write_bytes(b"windows")
        replace_durably(tmp, target)
    assert target.read_bytes() == b"windows"
    with pytest.raises(ValueError), temp_beside(target) as tmp:
        tmp.write_bytes(b"half")
        raise ValueError("tokenizer failed")
    assert target.read_bytes() == b"windows" and _others(tmp_path, target.name) == []


def test_link_or_copy_links_on_one_filesystem_and_copies_across(
    tmp_path: Path, monkeypatch
) -> None:
    import errno

    from crossfed.fileio import link_or_copy

    source = tmp_path / "model.safetensors"
    source.write_bytes(b"weights" * 1000)
    linked = tmp_path / "kept" / "global-3.safetensors"
    link_or_copy(source, linked)
    assert linked.read_bytes() == source.read_bytes()
    assert os.stat(linked).st_ino == os.stat(source).st_ino  # a hard link, no copy

    def cross_device(src, dst):  # what the kernel answers across filesystems
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    copied = tmp_path / "other" / "global-3.safetensors"
    link_or_copy(source, copied)
    assert copied.read_bytes() == source.read_bytes()
    assert os.stat(copied).st_ino != os.stat(source).st_ino
    leftovers = [p.name for p in tmp_path.rglob(".*")]
    assert leftovers == [], leftovers  # no temp file left behind either way
