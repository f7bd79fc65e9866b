"""Where a run's generations are made: in the coordinator's own process (:class:`LocalMerger`,
the default) or by a merge worker beside the object store (:class:`RemoteMerger`, talking to
``crossfed coordinator worker``), which takes every delta and model byte off the coordinator.

Both answer the same calls with plain values: :meth:`~LocalMerger.check` (an uploaded
object's digest and delta check), :meth:`~LocalMerger.initial` (generation 0),
:meth:`~LocalMerger.merge` (Eq. 1 over a round's deltas into the next generation),
:meth:`~LocalMerger.shapes` and :meth:`~LocalMerger.retain`. The fp32 master and momentum
live where the merger writes them: the coordinator's state dir, or the worker's. The
coordinator keeps the authority (which generation is committed, which delta is whose).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch

from crossfed import moments, rowcounts
from crossfed.backoff import Backoff
from crossfed.coordinator.blobs import BlobError
from crossfed.coordinator.generations import (
    Emit,
    merge_step,
    model_file_bytes,
    read_shapes,
    write_generation,
)
from crossfed.coordinator.objectstore import ModelUpload, ObjectStore, open_objects
from crossfed.coordinator.s3blobs import Checked, check_object
from crossfed.outer import OuterStepReport
from crossfed.outer_presets import OuterConfig
from crossfed.wire.codecs import DecodedDelta, decoded
from crossfed.wire.tensors import TensorFile

Shapes = dict[str, tuple[int, ...]]
T = TypeVar("T")
log = logging.getLogger("crossfed.coordinator")
_MODEL_FILE = re.compile(r"^(master|global)-(\d{6,})\.safetensors$")


@dataclass
class Written:
    """A generation written: its global model's digest and size, the seconds its writer
    spent (overlapping the merge), and for a merge the outer step's report; for generation 0
    the master's tensor names and shapes."""

    digest: str
    model_bytes: int
    checkpoint_s: float
    report: OuterStepReport | None = None
    shapes: Shapes = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "model_bytes": self.model_bytes,
            "checkpoint_s": self.checkpoint_s,
            "report": None if self.report is None else asdict(self.report),
            "shapes": shape_pairs(self.shapes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Written:
        report = data.get("report")
        return cls(
            digest=str(data["digest"]),
            model_bytes=int(data["model_bytes"]),
            checkpoint_s=float(data["checkpoint_s"]),
            report=None if report is None else OuterStepReport(**report),
            shapes=shapes_of(data["shapes"]),
        )


class LocalMerger:
    """Generations written in this process: the fp32 master and momentum and the bf16 global
    model in ``models_dir``; with ``objects``, deltas named by object are read from the
    store in ranges and each global model goes up to its object while it is written."""

    def __init__(self, models_dir: Path, objects: ObjectStore | None = None) -> None:
        self.models_dir, self.objects = models_dir, objects
        self.models_dir.mkdir(parents=True, exist_ok=True)

    def master_path(self, generation: int) -> Path:
        return self.models_dir / f"master-{generation:06d}.safetensors"

    def model_path(self, generation: int) -> Path:
        return self.models_dir / f"global-{generation:06d}.safetensors"

    def shapes(self, generation: int) -> Shapes:
        """Generation ``generation``'s master tensors, from its file's header."""
        return read_shapes(self.master_path(generation))

    def check(self, name: str, algo: str, size: int, shapes: Shapes | None) -> Checked:
        """Object ``name`` of ``size`` bytes read back: its ``algo`` digest and, with the
        run's ``shapes``, the delta check made in the same pass."""
        assert self.objects is not None, "checking an object needs the object store"
        return check_object(self.objects, name, algo, size, shapes)

    def initial(
        self, flavour: str, vocab_size: int, model_seed: int, model_object: str | None = None
    ) -> Written:
        """Generation 0 from the model seed, drawn one layer at a time (build_model's
        weights, bit for bit): no more memory than the largest layer."""
        # torchtitan is heavy: imported when a run is created
        from crossfed.train.model import initial_parameters, parameter_shapes

        shapes = parameter_shapes(flavour, vocab_size=vocab_size)

        def fill(emit: Emit) -> None:
            for name, value in initial_parameters(flavour, vocab_size=vocab_size, seed=model_seed):
                emit(name, value.float().contiguous(), None)

        digest, _, checkpoint_s, size = self._write(0, shapes, fill, False, {}, model_object)
        return Written(digest, size, checkpoint_s, shapes=shapes)

    def merge(
        self,
        base: int,
        shapes: Shapes,
        deltas: Sequence[Path | str],
        tokens: Sequence[int],
        outer: OuterConfig,
        *,
        shared_moments: bool,
        sites: Sequence[str],
        model_object: str | None = None,
        row_counts: bool = False,
    ) -> Written:
        """Eq. 1 from generation ``base``'s files and the round's deltas (local files, or
        objects by name, opened side by side) into generation ``base + 1``'s; the merged
        second-moment factors (``shared_moments``) go to the end of its global model. With
        ``row_counts`` the rows of a tensor the deltas count rows of are weighted by those
        counts (:mod:`crossfed.rowcounts`)."""
        sources = self._open(deltas)
        sent = self._side_tensors(sources, shapes, sites, shared_moments, row_counts)
        extra = moments.merge([m for m, _ in sent], tokens) if shared_moments else {}
        counts = _by_tensor([c for _, c in sent]) if row_counts else None

        def step(emit: Emit) -> OuterStepReport:
            return merge_step(
                self.master_path(base), shapes, sources, tokens, emit, outer, row_counts=counts
            )

        digest, report, checkpoint_s, size = self._write(
            base + 1, shapes, step, True, extra, model_object
        )
        return Written(digest, size, checkpoint_s, report=report)

    def retain(self, oldest_master: int, oldest_global: int, keep_start: bool) -> None:
        """Delete masters before ``oldest_master`` (generation 0's kept with ``keep_start``,
        for a replay from the run's start), global models before ``oldest_global``, and temp
        files a killed write left (the merge that runs now is the only one)."""
        oldest = {"master": oldest_master, "global": oldest_global}
        for path in self.models_dir.iterdir():
            match = _MODEL_FILE.match(path.name)
            if match is not None:
                kind, generation = match.group(1), int(match.group(2))
                if generation < oldest[kind] and not (
                    keep_start and (kind, generation) == ("master", 0)
                ):
                    path.unlink(missing_ok=True)
            elif path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)

    def _open(self, deltas: Sequence[Path | str]) -> list[Path | TensorFile]:
        """Local files as they are; objects opened side by side (each opening is a round
        trip to the store)."""
        names = [d for d in deltas if isinstance(d, str)]
        if not names:
            return list(deltas)  # type: ignore[arg-type]
        assert self.objects is not None, "deltas named by object need the object store"
        opened = iter(open_objects(self.objects, names))
        return [next(opened) if isinstance(d, str) else d for d in deltas]

    def _side_tensors(
        self,
        sources: Sequence[Path | TensorFile],
        shapes: Shapes,
        sites: Sequence[str],
        factors: bool,
        counts: bool,
    ) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """Each delta's second-moment factors and row counts (when asked); what does not fit
        the model is left out, and logged."""
        if not factors and not counts:
            return [({}, {}) for _ in sources]

        def read(source: Path | TensorFile) -> tuple[dict, dict]:
            def both(delta: DecodedDelta) -> tuple[dict, dict]:
                return (
                    delta.moments() if factors else {},
                    delta.row_counts() if counts else {},
                )

            if isinstance(source, TensorFile):  # an object: the merge closes it
                return both(decoded(source))
            with TensorFile(source) as handle:
                return both(decoded(handle))

        with ThreadPoolExecutor(max_workers=max(1, len(sources))) as pool:  # trips overlap
            read_back = list(pool.map(read, sources))
        out = []
        for site, (sent_factors, sent_counts) in zip(sites, read_back, strict=True):
            wrong = moments.problem(sent_factors, shapes)
            if wrong:
                log.warning("second-moment factors of site %s left out: %s", site, wrong)
                sent_factors = {}
            wrong = rowcounts.problem(sent_counts, shapes)
            if wrong:
                log.warning("row counts of site %s left out: %s", site, wrong)
                sent_counts = {}
            out.append((sent_factors, sent_counts))
        return out

    def _write(
        self,
        generation: int,
        shapes: Shapes,
        fill: Callable[[Emit], T],
        momentum: bool,
        extra: dict[str, torch.Tensor],
        model_object: str | None,
    ) -> tuple[str, T, float, int]:
        """Generation ``generation``'s files as ``fill`` produces its tensors; with
        ``model_object`` the global model goes up to the store part by part as it is
        written, and is stored whole before this returns (a failed write leaves no object).
        Returns the digest, ``fill``'s result, the writer's seconds and the model's bytes."""
        size = model_file_bytes(shapes, generation, extra)
        upload = None
        if model_object is not None:
            assert self.objects is not None, "a model object needs the object store"
            upload = ModelUpload(self.objects, model_object, size)
        try:
            digest, result, checkpoint_s = write_generation(
                self.master_path(generation),
                self.model_path(generation),
                shapes,
                generation,
                fill,
                momentum=momentum,
                extra=extra,
                model_progress=None if upload is None else upload.written,
            )
            if upload is not None:
                upload.finish()
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        return digest, result, checkpoint_s, size


class WorkerError(BlobError):
    """The merge worker refused a call, failed it, or could not be reached."""


class RemoteMerger:
    """A merge worker (``crossfed coordinator worker``) beside the object store, over HTTP:
    the same calls as :class:`LocalMerger`, its deltas always objects by name. The worker
    authenticates the coordinator by the run's admin token. A call that cannot reach the
    worker is retried with backoff for ``retry_budget_s``, then fails as 503
    ``worker_unavailable``; the worker's own refusals keep their status and code."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 3600.0,
        retry_budget_s: float = 60.0,
        verify: Any = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry_budget_s = retry_budget_s
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            verify=verify,
        )

    def close(self) -> None:
        self.client.close()

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, retry: bool = True
    ) -> Any:
        """The worker's answer; ``retry=False``: one try (a call made under the
        coordinator's lock must not hold it for a retry budget)."""
        backoff = Backoff(0.5, 5.0, jitter=True, budget_s=self.retry_budget_s if retry else 0.0)
        while True:
            try:
                response = self.client.request(method, path, json=body)
            except httpx.TransportError as exc:
                if backoff.wait():
                    continue
                raise WorkerError(
                    f"the merge worker at {self.url} did not answer ({type(exc).__name__}: "
                    f"{exc}); start it (crossfed coordinator worker) or check the URL",
                    503,
                    "worker_unavailable",
                ) from exc
            if response.status_code < 400:
                return response.json()
            try:
                error = response.json()
                code, message = str(error["error"]), str(error["detail"])
            except (ValueError, KeyError, TypeError):
                code, message = "worker_error", response.text[:500]
            raise WorkerError(f"merge worker: {message}", response.status_code, code)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/v1/health")

    def traffic(self) -> dict[str, int]:
        """The worker's own bytes read from and written to the object store."""
        return self._call("GET", "/v1/traffic")

    def shapes(self, generation: int) -> Shapes:
        answer = self._call("GET", f"/v1/generations/{generation}/shapes")
        return shapes_of(answer["shapes"])

    def check(self, name: str, algo: str, size: int, shapes: Shapes | None) -> Checked:
        answer = self._call("POST", "/v1/check", {
            "name": name, "algo": algo, "size": size,
            "shapes": None if shapes is None else shape_pairs(shapes),
        })  # fmt: skip
        return Checked(str(answer["digest"]), int(answer["size"]), bool(answer["passed"]))

    def initial(
        self, flavour: str, vocab_size: int, model_seed: int, model_object: str | None = None
    ) -> Written:
        answer = self._call("POST", "/v1/generations/0", {
            "flavour": flavour, "vocab_size": vocab_size, "model_seed": model_seed,
            "model_object": model_object,
        })  # fmt: skip
        return Written.from_dict(answer)

    def merge(
        self,
        base: int,
        shapes: Shapes,
        deltas: Sequence[Path | str],
        tokens: Sequence[int],
        outer: OuterConfig,
        *,
        shared_moments: bool,
        sites: Sequence[str],
        model_object: str | None = None,
        row_counts: bool = False,
    ) -> Written:
        if not all(isinstance(d, str) for d in deltas):
            raise ValueError("a merge worker reads deltas from the object store only")
        answer = self._call("POST", f"/v1/generations/{base + 1}", {
            "base": base, "shapes": shape_pairs(shapes), "deltas": list(deltas),
            "tokens": list(tokens), "outer": asdict(outer), "shared_moments": shared_moments,
            "sites": list(sites), "model_object": model_object, "row_counts": row_counts,
        })  # fmt: skip
        return Written.from_dict(answer)

    def retain(self, oldest_master: int, oldest_global: int, keep_start: bool) -> None:
        self._call("POST", "/v1/retain", {
            "oldest_master": oldest_master, "oldest_global": oldest_global,
            "keep_start": keep_start,
        }, retry=False)  # fmt: skip


def _by_tensor(sent: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, list[torch.Tensor | None]]:
    """Row counts by the tensor they count, one entry per delta (None: that delta sent none)."""
    params = sorted({key.removeprefix(rowcounts.PREFIX) for counts in sent for key in counts})
    return {p: [counts.get(rowcounts.count_key(p)) for counts in sent] for p in params}


def shape_pairs(shapes: Shapes) -> list[list[Any]]:
    """Tensor names and shapes as JSON keeps them, in order: ``[[name, [dims]], ...]``."""
    return [[name, list(shape)] for name, shape in shapes.items()]


def shapes_of(pairs: Iterable[Sequence[Any]]) -> Shapes:
    """The shapes :func:`shape_pairs` wrote."""
    return {str(name): tuple(int(n) for n in shape) for name, shape in pairs}


#: what the coordinator writes its generations with
Merger = LocalMerger | RemoteMerger
