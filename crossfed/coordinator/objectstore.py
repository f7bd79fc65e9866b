"""An S3-compatible object store as the coordinator sees it (boto3): settings, presigned URLs,
multipart uploads it starts and completes for the sites, streamed reads and its own writes.

The coordinator holds the credentials; sites never do. A site gets presigned URLs for the
parts of its own upload and for the objects it may read, and moves the bytes itself. The
coordinator completes an upload only from the parts the store lists (never trusting a
client's list), reads objects back in ranges (:class:`ObjectTensorFile`: a merge streams a
delta tensor by tensor) and writes the global models with s3transfer.

Settings come from the run config's ``blobs.s3`` section; the access key from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) or else the coordinator's
secrets file (``s3: {access_key_id: ..., secret_access_key: ...}``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import yaml
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from crossfed.coordinator.blobs import BlobError
from crossfed.wire.digests import CHUNK, new_hasher
from crossfed.wire.tensors import TensorFile

log = logging.getLogger("crossfed.coordinator")
#: S3's smallest part (all but the last part of a multipart upload)
MIN_PART_BYTES = 5 << 20
#: S3's most parts in one multipart upload
MAX_PARTS = 10_000
DEFAULT_PART_BYTES = 64 << 20
DEFAULT_URL_EXPIRY_S = 900.0
BACKENDS = ("file", "s3")


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
    known = {"endpoint", "bucket", "region", "prefix", "url_expiry_s", "part_bytes"}
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

    def complete_upload(self, name: str, upload_id: str, size: int) -> None:
        """Join the stored parts of an upload of ``size`` bytes into object ``name``; a part
        missing or of the wrong size is refused (409 ``missing_part``) and nothing changes."""
        listed = self.listed_parts(name, upload_id)
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
        self, name: str, algo: str, also: Callable[[bytes], None] | None = None
    ) -> tuple[str, int]:
        """The object's ``algo:hex`` digest and size, read as a stream (a chunk at a time);
        ``also`` sees each chunk too (a check made in the same pass)."""
        hasher, size = new_hasher(algo), 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=name)["Body"]
            for chunk in body.iter_chunks(CHUNK):
                hasher.update(chunk)
                size += len(chunk)
                if also is not None:
                    also(chunk)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _unreachable("reading an object back", exc) from exc
        self.moved["read"] += size
        return f"{algo}:{hasher.hexdigest()}", size

    def read_range(self, name: str, offset: int, view: memoryview) -> int:
        """Bytes of object ``name`` at ``offset`` into ``view``; how many arrived."""
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
        self.moved["read"] += done
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
        self.moved["written"] += path.stat().st_size

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

    def __init__(self, store: ObjectStore, name: str) -> None:
        self.store, self.name, self.path = store, name, Path(name)
        self._fd = -1
        size = store.size(name)
        if size is None:
            raise FileNotFoundError(f"no object {name} in bucket {store.bucket}")
        self._meta, self._entries = self._parse(size)

    def _pread(self, length: int, offset: int) -> bytes:
        buffer = bytearray(length)
        done = self._readinto(memoryview(buffer), offset)
        return bytes(buffer[:done])

    def _readinto(self, view: memoryview, offset: int) -> int:
        return self.store.read_range(self.name, offset, view.cast("B"))

    def close(self) -> None:
        return None


def open_object_store(path: str | Path, secrets_path: Path | None) -> ObjectStore | None:
    """The object store a ``blobs`` YAML file names, checked to answer (None: ``file``)."""
    section = load_blobs_section(Path(path))
    if backend_of(section) == "file":
        return None
    objects = ObjectStore(s3_settings(section, secrets_path))
    objects.check()
    return objects
