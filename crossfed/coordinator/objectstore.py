"""An S3-compatible object store as the coordinator sees it (boto3): settings, presigned URLs,
multipart uploads it starts and completes for the sites, streamed reads and its own writes.

The coordinator holds the credentials; sites never do. A site gets presigned URLs for the
parts of its own upload and for the objects it may read, and moves the bytes itself. The
coordinator completes an upload only from the parts the store lists (never trusting a
client's list), reads objects back in ranges, several at once (a digest's read-back;
:class:`ObjectTensorFile`: a merge streams a delta tensor by tensor) and writes each global
model part by part while the merge writes its file (:class:`ModelUpload`).

Settings come from the run config's ``blobs.s3`` section; the access key from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) or else the coordinator's
secrets file (``s3: {access_key_id: ..., secret_access_key: ...}``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import yaml
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from crossfed.config.run import EMBEDDED_WORKER
from crossfed.coordinator.blobs import BlobError
from crossfed.wire.digests import new_hasher
from crossfed.wire.tensors import TensorFile

log = logging.getLogger("crossfed.coordinator")
#: S3's smallest part (all but the last part of a multipart upload)
MIN_PART_BYTES = 5 << 20
#: S3's most parts in one multipart upload
MAX_PARTS = 10_000
DEFAULT_PART_BYTES = 64 << 20
DEFAULT_URL_EXPIRY_S = 900.0
#: bytes of one ranged read when the coordinator reads an object back for its digest
STRIPE_BYTES = 16 << 20
#: the first bytes of an object a merge opens, read with its size in one GET: a safetensors
#: header of a few hundred tensors (a model's, its factors' included) fits
HEAD_BYTES = 64 << 10
BACKENDS = ("file", "s3")


#: the ``blobs.s3`` key naming a merge worker
MERGE_WORKER = "merge_worker"


class ObjectStoreError(BlobError):
    """The object store refused or could not be reached; ``status`` is the HTTP answer."""


class ObjectStoreConfigError(ValueError):
    """The ``blobs`` settings or the credentials are missing or wrong."""


@dataclass(frozen=True)
class S3Settings:
    """Where the objects live and how the coordinator signs for them."""

    bucket: str
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    endpoint: str | None = None  # None: AWS S3 itself
    region: str = "us-east-1"
    prefix: str = ""
    url_expiry_s: float = DEFAULT_URL_EXPIRY_S
    part_bytes: int = DEFAULT_PART_BYTES

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ObjectStoreConfigError("blobs.s3.bucket is required with blobs.backend: s3")
        if not self.url_expiry_s > 0:
            raise ObjectStoreConfigError(f"blobs.s3.url_expiry_s must be > 0: {self.url_expiry_s}")
        if self.part_bytes < MIN_PART_BYTES:
            raise ObjectStoreConfigError(
                f"blobs.s3.part_bytes must be at least {MIN_PART_BYTES} (S3's smallest part), "
                f"got {self.part_bytes}"
            )
        if self.prefix.startswith("/"):
            raise ObjectStoreConfigError(f"blobs.s3.prefix must not start with '/': {self.prefix}")


def backend_of(blobs: Mapping[str, Any] | None) -> str:
    """``file`` or ``s3`` from a ``blobs`` section (``file`` when absent)."""
    backend = str((blobs or {}).get("backend", "file"))
    if backend not in BACKENDS:
        raise ObjectStoreConfigError(f"blobs.backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def merge_worker_of(blobs: Mapping[str, Any]) -> str | None:
    """``blobs.s3.merge_worker``: a merge worker's URL, :data:`EMBEDDED_WORKER`, or None."""
    value = (blobs.get("s3") or {}).get(MERGE_WORKER) if backend_of(blobs) == "s3" else None
    if value is None:
        return None
    text = str(value).rstrip("/")
    if text != EMBEDDED_WORKER and not text.startswith(("http://", "https://")):
        raise ObjectStoreConfigError(
            f"blobs.s3.{MERGE_WORKER} must be a URL (https://host:port) or "
            f"'{EMBEDDED_WORKER}', got {value!r}"
        )
    return text


def load_blobs_section(path: Path) -> dict[str, Any]:
    """The ``blobs`` section of a YAML file: a run config holding one, or the section alone."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ObjectStoreConfigError(f"cannot read blob settings from {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ObjectStoreConfigError(f"{path}: a mapping with a 'blobs' section expected")
    section = data.get("blobs", data)
    if not isinstance(section, dict):
        raise ObjectStoreConfigError(f"{path}: 'blobs' must be a mapping")
    return section


def s3_settings(
    blobs: Mapping[str, Any],
    secrets_path: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> S3Settings:
    """The S3 settings of a ``blobs`` section with ``backend: s3``; credentials from
    ``environ`` (default: the process environment), else from the secrets file's ``s3``."""
    environ = os.environ if environ is None else environ
    options = blobs.get("s3") or {}
    if not isinstance(options, Mapping):
        raise ObjectStoreConfigError("blobs.s3 must be a mapping")
    known = {"endpoint", "bucket", "region", "prefix", "url_expiry_s", "part_bytes", MERGE_WORKER}
    if unknown := sorted(set(options) - known):
        raise ObjectStoreConfigError(f"blobs.s3 has unknown keys {unknown}; known: {sorted(known)}")
    key_id = environ.get("AWS_ACCESS_KEY_ID")
    secret = environ.get("AWS_SECRET_ACCESS_KEY")
    source = "the environment"
    if not (key_id and secret) and secrets_path is not None and secrets_path.exists():
        data = yaml.safe_load(secrets_path.read_text()) or {}
        s3 = data.get("s3") if isinstance(data, dict) else None
        if isinstance(s3, dict):
            key_id, secret = s3.get("access_key_id"), s3.get("secret_access_key")
            source = str(secrets_path)
    if not (key_id and secret):
        raise ObjectStoreConfigError(
            "blobs.backend: s3 needs credentials: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the coordinator's environment, or an 's3' mapping with "
            "'access_key_id' and 'secret_access_key' in its secrets file"
            + (f" ({secrets_path})" if secrets_path is not None else "")
        )
    log.info("object store credentials from %s", source)
    prefix = str(options.get("prefix") or "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return S3Settings(
        bucket=str(options.get("bucket") or ""),
        access_key_id=str(key_id),
        secret_access_key=str(secret),
        endpoint=options.get("endpoint") or None,
        region=str(options.get("region") or "us-east-1"),
        prefix=prefix,
        url_expiry_s=float(options.get("url_expiry_s", DEFAULT_URL_EXPIRY_S)),
        part_bytes=int(options.get("part_bytes", DEFAULT_PART_BYTES)),
    )


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _unreachable(what: str, exc: Exception) -> ObjectStoreError:
    return ObjectStoreError(
        f"the object store did not answer ({what}): {exc}; nothing was changed, try again",
        503,
        "store_unavailable",
    )


class ObjectStore:
    """One bucket (under ``prefix``) through boto3, with the coordinator's credentials."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.bucket, self.prefix = settings.bucket, settings.prefix
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.endpoint,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "max_attempts": 3},
                connect_timeout=5,
                read_timeout=60,
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=settings.part_bytes,
            multipart_chunksize=settings.part_bytes,
            max_concurrency=4,
        )
        #: bytes this process moved to and from the store, by direction
        self.moved = {"read": 0, "written": 0}
        self._moved_lock = threading.Lock()  # reads and part uploads run on several threads

    def _count(self, direction: str, n: int) -> None:
        with self._moved_lock:
            self.moved[direction] += n

    def check(self) -> None:
        """The bucket answers with these credentials, or a clear error saying why not."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = _code(exc)
            if code in ("404", "NoSuchBucket"):
                raise ObjectStoreConfigError(
                    f"bucket {self.bucket!r} does not exist at {self._where()}; create it first"
                ) from exc
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise ObjectStoreConfigError(
                    f"the credentials may not use bucket {self.bucket!r} at {self._where()} "
                    f"({code}); see docs/objectstore.md for the permissions the coordinator needs"
                ) from exc
            raise ObjectStoreConfigError(f"bucket {self.bucket!r}: {exc}") from exc
        except BotoCoreError as exc:
            raise ObjectStoreConfigError(
                f"the object store at {self._where()} cannot be reached: {exc}"
            ) from exc

    def _where(self) -> str:
        return self.settings.endpoint or f"AWS S3 ({self.settings.region})"

    # ------------------------------------------------------------------ uploads
    def part_layout(self, size: int) -> list[tuple[int, int, int]]:
        """``(number, offset, length)`` of each part of a ``size``-byte upload."""
        part = max(self.settings.part_bytes, math.ceil(size / MAX_PARTS))
        count = max(1, math.ceil(size / part))
        return [(n + 1, n * part, min(part, size - n * part)) for n in range(count)]

    def start_upload(self, name: str) -> str:
        """A new multipart upload of object ``name``; its upload id."""
        try:
            return self.client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            raise _unreachable("starting an upload", exc) from exc

    def presign_parts(self, name: str, upload_id: str, size: int) -> list[dict[str, Any]]:
        """Presigned PUT URLs for every part of an upload (they expire after ``url_expiry_s``)."""
        return [
            {
                "number": number,
                "offset": offset,
                "bytes": length,
                "url": self.client.generate_presigned_url(
                    "upload_part",
                    Params={
                        "Bucket": self.bucket,
                        "Key": name,
                        "UploadId": upload_id,
                        "PartNumber": number,
                    },
                    ExpiresIn=int(self.settings.url_expiry_s),
                ),
            }
            for number, offset, length in self.part_layout(size)
        ]

    def listed_parts(self, name: str, upload_id: str) -> dict[int, tuple[str, int]] | None:
        """The parts the store holds of an upload, ``{number: (etag, size)}``; None when the
        upload is unknown (completed, aborted or never started)."""
        parts: dict[int, tuple[str, int]] = {}
        marker = 0
        try:
            while True:
                page = self.client.list_parts(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumberMarker=marker
                )
                for part in page.get("Parts", []):
                    parts[int(part["PartNumber"])] = (part["ETag"], int(part["Size"]))
                if not page.get("IsTruncated"):
                    return parts
                marker = int(page["NextPartNumberMarker"])
        except ClientError as exc:
            if _code(exc) in ("NoSuchUpload", "404"):
                return None
            raise _unreachable("listing an upload's parts", exc) from exc
        except BotoCoreError as exc:
            raise _unreachable("listing an upload's parts", exc) from exc

    def complete_upload(
        self,
        name: str,
        upload_id: str,
        size: int,
        listed: dict[int, tuple[str, int]] | None = None,
    ) -> None:
        """Join the stored parts of an upload of ``size`` bytes into object ``name``; a part
        missing or of the wrong size is refused (409 ``missing_part``) and nothing changes.
        ``listed``: the upload's parts as :meth:`listed_parts` just gave them (not asked
        again)."""
        listed = self.listed_parts(name, upload_id) if listed is None else listed
        if listed is None:
            raise ObjectStoreError(
                f"upload {upload_id} of {name} is not open (completed, aborted or unknown); "
                "ask for a new upload",
                404,
                "unknown_upload",
            )
        layout = self.part_layout(size)
        missing = [n for n, _, length in layout if listed.get(n, ("", -1))[1] != length]
        if missing:
            raise ObjectStoreError(
                f"upload of {name} is incomplete: part(s) {missing} of {len(layout)} are missing "
                "or of the wrong size; upload them and complete again",
                409,
                "missing_part",
                missing=missing,
            )
        parts = [{"PartNumber": n, "ETag": listed[n][0]} for n, _, _ in layout]
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except (ClientError, BotoCoreError) as exc:
            raise _unreachable("completing an upload", exc) from exc

    def upload_part_from(
        self, name: str, upload_id: str, number: int, fd: int, offset: int, length: int
    ) -> None:
        """Part ``number`` of an upload: ``length`` bytes of the open file ``fd`` at
        ``offset`` (read when the part goes up, so only the parts in flight are in memory)."""
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise ObjectStoreError(f"{name}: part {number} has {len(data)} of {length} bytes")
        try:
            self.client.upload_part(
                Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=data
            )
        except (ClientError, BotoCoreError) as exc:
            raise _unreachable(f"writing part {number} of {name}", exc) from exc
        self._count("written", length)

    def abort_upload(self, name: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
        except ClientError as exc:
            if _code(exc) not in ("NoSuchUpload", "404"):
                raise _unreachable("aborting an upload", exc) from exc
        except BotoCoreError as exc:
            raise _unreachable("aborting an upload", exc) from exc

    def open_uploads(self, under: str) -> Iterator[tuple[str, str, float]]:
        """``(name, upload_id, started)`` of the multipart uploads open under ``under``."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": under}
        while True:
            try:
                page = self.client.list_multipart_uploads(**kwargs)
            except (ClientError, BotoCoreError) as exc:
                raise _unreachable(f"listing the uploads under {under}", exc) from exc
            for upload in page.get("Uploads", []):
                yield upload["Key"], upload["UploadId"], _seconds(upload.get("Initiated"))
            if not page.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = page.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")

    # ------------------------------------------------------------------ objects
    def size(self, name: str) -> int | None:
        """The object's size, None when there is none."""
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=name)["ContentLength"])
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _unreachable("looking up an object", exc) from exc
        except BotoCoreError as exc:
            raise _unreachable("looking up an object", exc) from exc

    def digest(
        self,
        name: str,
        algo: str,
        also: Callable[[bytes], None] | None = None,
        size: int | None = None,
    ) -> tuple[str, int]:
        """The object's ``algo:hex`` digest and size, read back in ranges of
        :data:`STRIPE_BYTES`, up to ``max_concurrency`` of them at once (on a long link one
        stream is bound by its window), and hashed in order; ``also`` sees each range too, in
        order (a check made in the same pass). What is in memory is the ranges in flight.
        ``size``: the object's size when the caller knows it (an upload it just joined from
        parts of checked sizes), which saves asking the store for it."""
        size = self.size(name) if size is None else size
        if size is None:
            raise _unreachable("reading an object back", FileNotFoundError(name))
        hasher = new_hasher(algo)
        stripes = iter(range(0, size, STRIPE_BYTES))
        with ThreadPoolExecutor(
            max_workers=self.transfer.max_concurrency, thread_name_prefix="digest"
        ) as pool:
            reads: deque[Future[bytes]] = deque()

            def more() -> None:
                offset = next(stripes, None)
                if offset is not None:
                    length = min(STRIPE_BYTES, size - offset)
                    reads.append(pool.submit(self._range, name, offset, length))

            for _ in range(self.transfer.max_concurrency):
                more()
            try:
                while reads:
                    data = reads.popleft().result()
                    more()
                    hasher.update(data)
                    if also is not None:
                        also(data)
            finally:
                for read in reads:
                    read.cancel()
        self._count("read", size)
        return f"{algo}:{hasher.hexdigest()}", size

    def _range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` at ``offset``, all of them or an error."""
        data = bytearray(length)
        got = self._fetch(name, offset, memoryview(data))
        if got != length:
            raise _unreachable("reading an object back", EOFError(f"{got} of {length} bytes"))
        return bytes(data)

    def read_head(self, name: str, length: int) -> tuple[bytes, int]:
        """The first ``length`` bytes of object ``name`` (fewer if it is shorter) and its
        size, in one GET (a HEAD and then a GET would be two round trips)."""
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes=0-{max(length, 1) - 1}"
            )
            head = response["Body"].read()
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"no object {name} in bucket {self.bucket}") from None
            if _code(exc) in ("416", "InvalidRange"):  # an empty object has no first byte
                return b"", 0
            raise _unreachable(f"reading {name}", exc) from exc
        except (BotoCoreError, OSError) as exc:
            raise _unreachable(f"reading {name}", exc) from exc
        self._count("read", len(head))
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        return head, int(total) if total.isdigit() else len(head)

    def read_range(self, name: str, offset: int, view: memoryview) -> int:
        """Bytes of object ``name`` at ``offset`` into ``view``; how many arrived."""
        done = self._fetch(name, offset, view)
        self._count("read", done)
        return done

    def _fetch(self, name: str, offset: int, view: memoryview) -> int:
        if not len(view):
            return 0
        last = offset + len(view) - 1
        done = 0
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={offset}-{last}"
            )
            for chunk in response["Body"].iter_chunks(1 << 20):
                view[done : done + len(chunk)] = chunk
                done += len(chunk)
        except (ClientError, BotoCoreError, OSError) as exc:
            # never a bad delta: the store is away (or lost the object), so say so
            raise _unreachable(f"reading {name}", exc) from exc
        return done

    def presign_get(self, name: str) -> str:
        return self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": name},
            ExpiresIn=int(self.settings.url_expiry_s),
        )

    def put_file(self, path: Path, name: str) -> None:
        """Upload a local file as object ``name`` (s3transfer: parts, in parallel, bounded)."""
        try:
            self.client.upload_file(str(path), self.bucket, name, Config=self.transfer)
        except (ClientError, BotoCoreError) as exc:
            raise _unreachable(f"writing {name}", exc) from exc
        self._count("written", path.stat().st_size)

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _code(exc) not in ("404", "NoSuchKey"):
                raise _unreachable(f"deleting {name}", exc) from exc
        except BotoCoreError as exc:
            raise _unreachable(f"deleting {name}", exc) from exc

    def objects(self, under: str) -> Iterator[tuple[str, float]]:
        """``(name, last modified)`` of the objects under ``under``."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=under):
                for item in page.get("Contents", []):
                    yield item["Key"], _seconds(item.get("LastModified"))
        except (ClientError, BotoCoreError) as exc:
            raise _unreachable(f"listing {under}", exc) from exc


def _seconds(stamp: Any) -> float:
    """A listing's timestamp as seconds since the epoch (now when it has none)."""
    if isinstance(stamp, datetime):
        return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()
    return time.time()


class ObjectTensorFile(TensorFile):
    """A safetensors object read tensor by tensor with ranged GETs, like :class:`TensorFile`
    reads a file with ``pread``: a reader holds the tensors it keeps and nothing more."""

    remote = True

    def __init__(self, store: ObjectStore, name: str) -> None:
        """Opening costs one GET (the object's first :data:`HEAD_BYTES` and its size), two
        when the safetensors header is longer."""
        self.store, self.name, self.path = store, name, Path(name)
        self._fd = -1
        self._head, size = store.read_head(name, HEAD_BYTES)
        self._whole = len(self._head) >= size  # a short object: all of it is here
        try:
            self._meta, self._entries = self._parse(size)
        finally:
            self._head, self._whole = b"", False  # the tensors are read in ranges of their own

    def _pread(self, length: int, offset: int) -> bytes:
        if self._whole or offset + length <= len(self._head):
            return self._head[offset : offset + length]
        buffer = bytearray(length)
        done = self._readinto(memoryview(buffer), offset)
        return bytes(buffer[:done])

    def _readinto(self, view: memoryview, offset: int) -> int:
        return self.store.read_range(self.name, offset, view.cast("B"))

    def close(self) -> None:
        return None


def open_objects(store: ObjectStore, names: list[str]) -> list[ObjectTensorFile]:
    """Objects ``names`` opened side by side as tensor files read in ranges (a round's
    deltas: each opening is a round trip to the store), in order; a missing one is
    ``FileNotFoundError`` naming it."""
    with ThreadPoolExecutor(max(1, len(names)), thread_name_prefix="delta-open") as pool:
        return list(pool.map(lambda name: ObjectTensorFile(store, name), names))


class ModelUpload:
    """Object ``name`` uploaded while its local file of ``size`` bytes is still being
    written (a merge's global model): :meth:`written` is the writer's progress hook, and each
    part of :meth:`ObjectStore.part_layout` goes up, on a thread of its own (at most the
    store's ``max_concurrency`` at once), as soon as the file holds its bytes; :meth:`finish`
    waits for them and completes the upload, :meth:`abort` drops it. The bytes are read back
    from the file, so the upload holds only the parts in flight."""

    def __init__(self, store: ObjectStore, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.layout = store.part_layout(size)
        self.upload_id = store.start_upload(name)
        self.pool = ThreadPoolExecutor(
            max_workers=store.transfer.max_concurrency, thread_name_prefix="model-upload"
        )
        self.sent: list[Future[None]] = []
        self.fd = -1

    def written(self, fd: int, done: int) -> None:
        """The first ``done`` bytes of the file open as ``fd`` are written."""
        if self.fd < 0:
            self.fd = os.dup(fd)  # kept open past the writer's close and rename
        while len(self.sent) < len(self.layout):
            number, offset, length = self.layout[len(self.sent)]
            if offset + length > done:
                return
            part = self.pool.submit(
                self.store.upload_part_from, self.name, self.upload_id, number, self.fd,
                offset, length,
            )  # fmt: skip
            self.sent.append(part)

    def finish(self) -> None:
        """Every part stored and the object complete, or the error of the first part that
        failed (then :meth:`abort` it)."""
        if len(self.sent) != len(self.layout):
            raise ObjectStoreError(
                f"{self.name}: {len(self.sent)} of {len(self.layout)} parts were written"
            )
        for part in self.sent:
            part.result()
        self.store.complete_upload(self.name, self.upload_id, self.size)
        self._close()

    def abort(self) -> None:
        """Drop the upload (a failed merge leaves no object); never raises."""
        for part in self.sent:
            part.cancel()
        self._close()
        try:
            self.store.abort_upload(self.name, self.upload_id)
        except ObjectStoreError as exc:  # the upload is reaped with the open ones later
            log.warning("could not abort the upload of %s: %s", self.name, exc)

    def _close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_object_store(path: str | Path, secrets_path: Path | None) -> ObjectStore | None:
    """The object store a ``blobs`` YAML file names, checked to answer (None: ``file``)."""
    section = load_blobs_section(Path(path))
    if backend_of(section) == "file":
        return None
    objects = ObjectStore(s3_settings(section, secrets_path))
    objects.check()
    return objects
