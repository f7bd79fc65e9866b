"""Deltas and global models in an S3-compatible store, with the coordinator as the authority.

A blob uploaded by ``owner`` (a site, or the admin) is the object
``<prefix>blobs/<owner>/<algo>/<hex>``: no site can touch another's object, even with the
same bytes. A site asks for an upload (:meth:`ObjectBlobs.begin`), puts its parts to the
presigned URLs it got, and says it has finished (:meth:`ObjectBlobs.complete`): the
coordinator joins the parts the store lists, has the object read back (by itself, or by a
merge worker beside the store) and keeps it only if it hashes to its key (then it is
recorded in SQLite as stored; a delta may refer to it). Global models are
``<prefix>models/global-<generation>.safetensors``, uploaded while the merge writes them
(:mod:`crossfed.coordinator.merger`), read by the sites through presigned URLs.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossfed.coordinator import store
from crossfed.coordinator.blobs import BlobError, check_key
from crossfed.coordinator.deltacheck import StreamingDeltaCheck
from crossfed.coordinator.objectstore import ObjectStore, ObjectTensorFile
from crossfed.wire.digests import parse_digest

#: reads an uploaded object back: (name, algo, size, the run's shapes or None) -> Checked
CheckObject = Callable[[str, str, int, Mapping[str, tuple[int, ...]] | None], "Checked"]


@dataclass
class Checked:
    """An uploaded object read back: its digest, its size, and whether it passed the
    streaming delta check (names, shapes, dtypes, finite values)."""

    digest: str
    size: int
    passed: bool


def check_object(
    objects: ObjectStore,
    name: str,
    algo: str,
    size: int,
    shapes: Mapping[str, tuple[int, ...]] | None,
) -> Checked:
    """Object ``name`` of ``size`` bytes read back (ranges side by side, hashed in order):
    its ``algo`` digest and, with the run's ``shapes``, the delta check in the same pass."""
    check = StreamingDeltaCheck(shapes) if shapes else None
    digest, got = objects.digest(name, algo, None if check is None else check.feed, size)
    return Checked(digest, got, check is not None and check.passed)


log = logging.getLogger("crossfed.coordinator")


class ObjectBlobs:
    """The run's blobs and global models in one bucket; records in the run's SQLite."""

    def __init__(
        self,
        objects: ObjectStore,
        conn: sqlite3.Connection,
        lock: threading.RLock,
        shapes: Callable[[], Mapping[str, tuple[int, ...]] | None] = lambda: None,
        check: CheckObject | None = None,
    ) -> None:
        """``shapes``: the run's master tensors (None before a run), for the delta check
        made while an upload is hashed; ``check``: what reads an upload back for its digest
        and that check (:meth:`crossfed.coordinator.merger.LocalMerger.check`, this
        process; or a merge worker's, beside the store)."""
        self.objects, self.conn, self.lock, self.shapes = objects, conn, lock, shapes
        self.check = check or self._check_here
        self._completing: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._published: set[int] = set()

    # ------------------------------------------------------------------ naming
    def blob_name(self, key: str, owner: str) -> str:
        algo, hexdigest = parse_digest(check_key(key))
        return f"{self.objects.prefix}blobs/{owner}/{algo}/{hexdigest}"

    def model_name(self, generation: int) -> str:
        return f"{self.objects.prefix}models/global-{generation:06d}.safetensors"

    # ------------------------------------------------------------------ records
    def stored(self, key: str) -> dict[str, int]:
        """Owner -> size of each verified object of blob ``key``."""
        with self.lock:
            return store.stored_objects(self.conn, check_key(key))

    def owner_for(self, key: str, site: str | None) -> str | None:
        """Whose object of ``key`` a delta of ``site`` refers to: the site's own if stored,
        else (the admin's submission) any verified one; None when there is none."""
        stored = self.stored(key)
        if site is not None and site in stored:
            return site
        return next(iter(sorted(stored)), None)

    # ------------------------------------------------------------------ uploads
    def begin(
        self, key: str, owner: str, size: int, upload_id: str | None = None
    ) -> dict[str, Any]:
        """Presigned part URLs for ``owner``'s upload of ``size`` bytes as blob ``key``: of
        upload ``upload_id`` (fresh URLs for an upload under way), else of a new upload.
        A blob already stored is answered complete, with no URLs."""
        key = check_key(key)
        if owner in self.stored(key):
            return {"key": key, "complete": True, "bytes": self.stored(key)[owner]}
        name = self.blob_name(key, owner)
        if upload_id is None:
            upload_id = self.objects.start_upload(name)
        elif self.objects.listed_parts(name, upload_id) is None:
            raise BlobError(
                f"upload {upload_id} of {key} is not open (completed, aborted or unknown); "
                "ask for a new upload",
                404,
                "unknown_upload",
            )
        return {
            "key": key,
            "complete": False,
            "upload_id": upload_id,
            "bytes": size,
            "expires_in_s": self.objects.settings.url_expiry_s,
            "parts": self.objects.presign_parts(name, upload_id, size),
        }

    def complete(self, key: str, owner: str, upload_id: str, size: int) -> dict[str, Any]:
        """Join the upload's parts and keep the object only if it hashes to ``key``.

        A part missing is 409 ``missing_part`` (the upload stays open); bytes that hash to
        something else are 422 ``digest_mismatch`` and the object is deleted. Completing an
        upload of a blob already stored changes nothing (the new upload is dropped). An
        upload no longer open whose object exists (the coordinator stopped between joining
        and checking) is checked now."""
        key = check_key(key)
        name = self.blob_name(key, owner)
        with self._lock_for(name):
            stored = self.stored(key)
            if owner in stored:
                self.objects.abort_upload(name, upload_id)
                return {"key": key, "complete": True, "bytes": stored[owner]}
            listed = self.objects.listed_parts(name, upload_id)
            if listed is not None:
                self.objects.complete_upload(name, upload_id, size, listed)
                joined: int | None = size  # the parts' sizes were checked against it
            else:
                joined = self.objects.size(name)
            if joined is None:
                raise BlobError(
                    f"upload {upload_id} of {key} is not open and no object was joined; "
                    "ask for a new upload",
                    404,
                    "unknown_upload",
                )
            shapes = self.shapes()
            checked = self.check(name, parse_digest(key)[0], joined, dict(shapes or {}) or None)
            actual, got = checked.digest, checked.size
            if actual != key:
                self.objects.delete(name)
                raise BlobError(
                    f"blob digest mismatch: the uploaded object hashes to {actual}, key says "
                    f"{key} (truncated or corrupted upload; it was deleted, upload it again)",
                    422,
                    "digest_mismatch",
                )
            with self.lock, store.Transaction(self.conn):
                store.add_stored_object(self.conn, key, owner, got)
                if checked.passed:
                    store.add_checked_object(self.conn, key, owner)
        return {"key": key, "complete": True, "bytes": got}

    def _check_here(
        self, name: str, algo: str, size: int, shapes: Mapping[str, tuple[int, ...]] | None
    ) -> Checked:
        return check_object(self.objects, name, algo, size, shapes)

    def checked(self, key: str, owner: str) -> bool:
        """Whether ``owner``'s object of ``key`` passed the delta check when it was hashed."""
        with self.lock:
            return store.is_checked_object(self.conn, check_key(key), owner)

    def _lock_for(self, name: str) -> threading.Lock:
        with self._guard:
            return self._completing.setdefault(name, threading.Lock())

    # ------------------------------------------------------------------ reads
    def open(self, key: str, owner: str) -> ObjectTensorFile:
        """Blob ``key`` of ``owner`` as a tensor file read in ranges."""
        return ObjectTensorFile(self.objects, self.blob_name(key, owner))

    def download(self, key: str, owner: str) -> dict[str, Any]:
        """A presigned GET of ``owner``'s stored blob ``key``."""
        size = self.stored(key)[owner]
        return {
            "key": key,
            "digest": key,
            "bytes": size,
            "url": self.objects.presign_get(self.blob_name(key, owner)),
            "expires_in_s": self.objects.settings.url_expiry_s,
        }

    # ------------------------------------------------------------------ models
    def published(self, generation: int) -> None:
        self._published.add(generation)

    def model(self, generation: int, path: Path, digest: str) -> dict[str, Any]:
        """A presigned GET of a global model, written to the store first if it is not there
        yet (the coordinator stopped between writing it and publishing it)."""
        name = self.model_name(generation)
        size = path.stat().st_size if path.exists() else None  # None: a merge worker's
        if generation not in self._published:
            stored = self.objects.size(name)
            if stored is None or (size is not None and stored != size):
                if size is None:
                    raise BlobError(f"no global model for generation {generation}", 404)
                self.objects.put_file(path, name)
            size = stored if size is None else size
            self._published.add(generation)
        return {
            "generation": generation,
            "digest": digest,
            "bytes": size if size is not None else self.objects.size(name),
            "url": self.objects.presign_get(name),
            "expires_in_s": self.objects.settings.url_expiry_s,
        }

    # ------------------------------------------------------------------ retention
    def prune(
        self, drop: Iterable[str], keep: Iterable[str], models_before: int, grace_s: float
    ) -> list[str]:
        """Delete the objects of the blobs in ``drop``, and objects or open uploads in neither
        set older than ``grace_s`` (uploaded but never submitted); global models of
        generations before ``models_before``, and models' uploads left open (a merge that
        stopped) older than ``grace_s``. Returns the blob keys deleted."""
        drop_set = {check_key(k) for k in drop}
        keep_set = {check_key(k) for k in keep} - drop_set
        cutoff = time.time() - grace_s
        deleted: set[str] = set()
        with self.lock:
            stored = store.all_stored_objects(self.conn)
        for key, owner in stored:
            if key in drop_set:
                self.objects.delete(self.blob_name(key, owner))
                with self.lock, store.Transaction(self.conn):
                    store.forget_stored_object(self.conn, key, owner)
                deleted.add(key)
        known = {self.blob_name(k, o) for k, o in stored if k not in drop_set}
        blobs = f"{self.objects.prefix}blobs/"
        for name, modified in self.objects.objects(blobs):
            key = _key_of(name, blobs)
            if key is None or key in keep_set or modified >= cutoff:
                continue
            if name in known:  # verified but never submitted: dropped after the grace
                owner = name[len(blobs) :].split("/", 1)[0]
                with self.lock, store.Transaction(self.conn):
                    store.forget_stored_object(self.conn, key, owner)
            self.objects.delete(name)
            deleted.add(key)
        for name, upload_id, started in self.objects.open_uploads(blobs):
            if started < cutoff and _key_of(name, blobs) not in keep_set:
                self.objects.abort_upload(name, upload_id)
        models = f"{self.objects.prefix}models/"
        for name, upload_id, started in self.objects.open_uploads(models):
            if started < cutoff:  # a model's upload a merge stopped in (a crash)
                self.objects.abort_upload(name, upload_id)
        for name, _ in self.objects.objects(models):
            stem = name[len(models) :].removeprefix("global-").removesuffix(".safetensors")
            if stem.isdigit() and int(stem) < models_before:
                self.objects.delete(name)
                self._published.discard(int(stem))
        return sorted(deleted)


def _key_of(name: str, blobs: str) -> str | None:
    """The blob key of object ``<blobs><owner>/<algo>/<hex>``, None for anything else."""
    parts = name[len(blobs) :].split("/")
    if len(parts) != 3:
        return None
    try:
        return check_key(f"{parts[1]}:{parts[2]}")
    except BlobError:
        return None
