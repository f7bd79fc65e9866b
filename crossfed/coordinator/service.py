"""The coordinator's logic: rounds, DARL leases and the merge, wired to SQLite and disk.

HTTP lives in ``app.py``; this class never sees a request. Every state change is written
to SQLite (one transaction) before the method returns, so whatever a reply promised
survives a SIGKILL. One lock serialises mutations; a merge takes it only to start and to
commit, so leases and heartbeats are answered while it reads and writes the model.

The model state is on disk, not in memory: each generation's fp32 master and momentum are
one safetensors file read tensor by tensor, and a merge writes the next generation's files
as it computes them, so the coordinator's memory does not grow with the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from crossfed import moments
from crossfed.coordinator import store
from crossfed.coordinator.blobs import BlobError, BlobStore, check_key
from crossfed.coordinator.faults import crash_point
from crossfed.coordinator.generations import (
    Emit,
    StateView,
    merge_step,
    read_shapes,
    write_generation,
)
from crossfed.coordinator.objectstore import ObjectStore
from crossfed.coordinator.rounds import close_decision, next_global_step
from crossfed.coordinator.runspec import (
    EXTENSIBLE,
    RunSpec,
    describe,
    differences,
    resolve_outer,
)
from crossfed.coordinator.s3blobs import ObjectBlobs
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import Lease, LeaseBook, LeaseError, lease_ttl
from crossfed.darl.ledger import CHECKPOINT_EVERY, LedgerError, LedgerStore, apply_event
from crossfed.outer import DeltaError, OuterStepReport, validate_delta, warm_up
from crossfed.wire.codecs import decoded, open_delta
from crossfed.wire.digests import digest_file
from crossfed.wire.tensors import TensorFile

log = logging.getLogger("crossfed.coordinator")
BLOB_GRACE_S = 3600.0  # an uploaded blob no delta refers to is deleted after this long
_MODEL_FILE = re.compile(r"^(master|global)-(\d{6,})\.safetensors$")
MAX_RTT_MS = 60_000.0  # a measured RTT sample is clamped to this
ECHOES_PER_SITE = 4  # outstanding RTT nonces kept per site (a site may beat for two leases)
PACE_LIVE_S = 3600.0  # sites seen within this long count towards the mean pace
PACE_MAX_SCALE = 4.0  # a grant is at most this many times the requested phase
#: set to 1, the merge holds the lock that leases and heartbeats wait on from start to commit
#: (how the coordinator merged before): for bench/heartbeat_merge.py's "before" figures only
MERGE_HOLDS_LOCK_ENV = "CROSSFED_MERGE_HOLDS_LOCK"
RESEND_FIELDS = ("site", "blob", "round_no", "generation", "tokens", "steps", "consumed")
T = TypeVar("T")


class CoordinatorError(Exception):
    """A refused request; ``status`` is the HTTP status, ``code`` a stable machine-readable word."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    @classmethod
    def of_lease(cls, status: int, exc: LeaseError) -> CoordinatorError:
        """A lease book refusal: its code once, its message without the code prefix."""
        return cls(status, exc.code, str(exc).removeprefix(f"{exc.code}: "))


@contextmanager
def lease_errors(status: int) -> Iterator[None]:
    """``with lease_errors(409):`` a lease book refusal in the block is raised as a
    :class:`CoordinatorError` with ``status``, its code and message kept."""
    try:
        yield
    except LeaseError as exc:
        raise CoordinatorError.of_lease(status, exc) from exc


class Coordinator:
    """State of one run: global model, momentum, rounds and the DARL ledger."""

    def __init__(
        self,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
        keep_generations: int = 3,
        keep_models: int | None = None,
        keep_deltas: bool = False,
        ledger_checkpoint_every: int = CHECKPOINT_EVERY,
        merge_holds_lock: bool | None = None,
        objects: ObjectStore | None = None,
    ) -> None:
        """``clock`` stamps leases, rounds and sites; ``monotonic`` times durations (RTT
        samples, the merge): ``time.perf_counter`` with the real clock, else ``clock``
        itself, so a fake clock drives both. ``merge_holds_lock`` (default: the
        ``CROSSFED_MERGE_HOLDS_LOCK`` environment variable) makes a merge hold the lock
        throughout, as it once did; it exists for the heartbeat-during-merge benchmark and
        its test, never for a run. ``objects``: deltas and global models live in this
        S3-compatible store (``blobs.backend: s3``) instead of ``state_dir/blobs``."""
        self.state_dir = state_dir
        self.clock = clock
        if monotonic is None:
            monotonic = time.perf_counter if clock is time.time else clock
        self.monotonic = monotonic
        if merge_holds_lock is None:
            merge_holds_lock = os.environ.get(MERGE_HOLDS_LOCK_ENV, "") == "1"
        self.merge_holds_lock = merge_holds_lock
        self.keep_generations = keep_generations
        #: bf16 global models kept (what sites download; 0: every generation), so a site that
        #: starts or resumes rounds behind still secures each round's model; the fp32 master
        #: and momentum (restarts need only the newest) keep ``keep_generations``
        self.keep_models = keep_generations if keep_models is None else keep_models
        #: keep every merged delta and generation 0's master: the run can be replayed from
        #: its start by an auditor (``bench/soak_check.py``); the disk grows every round
        self.keep_deltas = keep_deltas
        self.ledger_checkpoint_every = ledger_checkpoint_every
        self.lock = threading.RLock()
        self.conn = store.connect(state_dir / "state.sqlite")
        self.blobs = BlobStore(state_dir / "blobs")
        #: the object store's blobs and global models (None: the file store, ``self.blobs``)
        self.s3 = None
        if objects is not None:
            self.s3 = ObjectBlobs(objects, self.conn, self.lock, lambda: self.shapes or None)
        self.models_dir = state_dir / "models"
        self.ledger = LedgerStore(self.conn)
        self.spec: RunSpec | None = None
        self.space: BlockSpace | None = None
        self.book: LeaseBook | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}  # the master's tensors, in file order
        self.generation = 0  # the committed generation whose files hold the state
        #: the open round's number, read without the lock (a status long poll): 0 before a run
        self.open_round_no = 0
        self._closing: int | None = None  # the round a merge is closing, outside the lock
        self._echoes: dict[str, dict[int, float]] = {}  # site -> {nonce: monotonic at reply}
        self._rtt_ms: dict[str, float] = {}  # RTT the coordinator measured per site (smoothed)
        #: what each lease granted since this start asked for (its site's phase, in blocks)
        self._phase_blocks: dict[int, int] = {}
        #: blocks per second of compute per site, from the step times its heartbeats report
        self._step_rates: dict[str, float] = {}
        spec = store.get_meta(self.conn, "spec")
        if spec is not None:
            self._load(RunSpec.from_dict(spec))

    # ------------------------------------------------------------------ lifecycle
    def _load(self, spec: RunSpec) -> None:
        """Rebuild in-memory state from disk after a (re)start."""
        self.spec = spec
        self.space = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed)
        with store.Transaction(self.conn):  # a ledger of another block space is refused
            self.ledger.bind_space(self.space.digest(), self.space.n_blocks)
        self.book = LeaseBook(self.space.n_blocks)
        replayed = self.ledger.replay(self.book)
        if self.book.active_leases():  # sites could not heartbeat while we were down
            with self._mutation():
                self._event("grace", {"now": self.clock()})
        generation = self._restore_state()
        log.info("loaded run at generation %d (%d ledger events replayed)", generation, replayed)
        params = sum(math.prod(shape) for shape in self.shapes.values())
        threading.Thread(target=warm_up, args=(params,), name="warm-merge", daemon=True).start()

    def _restore_state(self) -> int:
        """The last committed generation and its master's tensor names and shapes (read
        from its file's header: the tensors themselves stay on disk until a merge)."""
        generation = store.get_meta(self.conn, "generation", 0)
        self.shapes = read_shapes(self._master_path(generation))
        self.generation = generation
        self.open_round_no = self.current_round()["round_no"]
        return generation

    def _references(self) -> dict[str, torch.Tensor]:
        """The master's names and shapes as storage-free tensors, for checking deltas."""
        return {k: torch.empty(shape, device="meta") for k, shape in self.shapes.items()}

    @property
    def master(self) -> StateView:
        """The committed generation's fp32 master, read from its file tensor by tensor."""
        return StateView(self._master_path(self.generation), momentum=False)

    @property
    def momentum(self) -> StateView:
        """The committed generation's momentum (empty before the first merge)."""
        return StateView(self._master_path(self.generation), momentum=True)

    def init_run(self, spec: RunSpec) -> dict[str, Any]:
        """Create the run (generation 0 from the model seed); the same spec again is a no-op."""
        with self.lock:
            existing = store.get_meta(self.conn, "spec")
            if existing is not None:
                current = RunSpec.from_dict(existing)
                return self._resume_run(current, resolve_outer(spec, current))
            spec = resolve_outer(spec, None)
            # torchtitan is heavy: imported when a run is created
            from crossfed.train.model import initial_parameters, parameter_shapes

            # generation 0 is drawn one layer at a time (build_model's weights, bit for
            # bit): creating a run needs no more memory than its largest layer
            self.shapes = parameter_shapes(spec.flavour, vocab_size=spec.vocab_size)

            def initial(emit: Emit) -> None:
                drawn = initial_parameters(
                    spec.flavour, vocab_size=spec.vocab_size, seed=spec.model_seed
                )
                for name, value in drawn:
                    emit(name, value.float().contiguous(), None)

            digest, _, _ = self._write_generation(0, initial, momentum=False)
            now = self.clock()
            with store.Transaction(self.conn):
                store.set_meta(self.conn, "global_digest:0", digest)
                store.set_meta(self.conn, "spec", spec.to_dict())
                store.set_meta(self.conn, "generation", 0)
                store.set_meta(self.conn, "global_step", 0)
                store.open_round(self.conn, 1, 0, now, 0)
            self._load(spec)
            return {"created": True, **self.status()}

    def _resume_run(self, current: RunSpec, spec: RunSpec) -> dict[str, Any]:
        """The same run again, or the same run with more rounds (a longer LR schedule).

        Only ``schedule.total_steps`` may change, and only upwards: the rounds already
        trained keep the learning rates they had; later rounds follow the longer schedule.
        Any other difference would change what the finished rounds mean, so it is refused.
        """
        changes = differences(current, spec)
        if not changes:
            return {"created": False, "extended": False, **self.status()}
        refused = {k: v for k, v in changes.items() if k not in EXTENSIBLE}
        if refused:
            raise CoordinatorError(
                409,
                "run_exists",
                f"this coordinator serves a run that differs from this config in "
                f"{describe(refused)}; a run in progress keeps its data, model, sites and "
                f"settings: use the run's config, or start a new run in a new state dir",
            )
        old_total, new_total = changes["schedule.total_steps"]
        if new_total < old_total:
            raise CoordinatorError(
                409,
                "run_exists",
                f"the run's schedule is {old_total} inner steps long; a run can be extended "
                f"(more rounds), not shortened to {new_total}",
            )
        with store.Transaction(self.conn):
            store.set_meta(self.conn, "spec", spec.to_dict())
        self.spec = spec
        log.info("run extended: schedule %d -> %d inner steps", old_total, new_total)
        return {"created": False, "extended": True, **self.status()}

    def _require_run(self) -> RunSpec:
        if self.spec is None:
            raise CoordinatorError(409, "no_run", "no run initialised; call POST /v1/run first")
        return self.spec

    # ------------------------------------------------------------------ files
    def _master_path(self, generation: int) -> Path:
        return self.models_dir / f"master-{generation:06d}.safetensors"

    def global_path(self, generation: int) -> Path:
        """The published bf16 model of ``generation`` (a generation whose merge has not
        committed yet is not published, even if a killed merge left its file behind)."""
        path = self._model_file(generation)
        if generation > store.get_meta(self.conn, "generation", 0) or not path.exists():
            raise CoordinatorError(
                404, "unknown_generation", f"no global model for generation {generation}"
            )
        return path

    def _model_file(self, generation: int) -> Path:
        """Where generation ``generation``'s bf16 global model is (or will be) written."""
        return self.models_dir / f"global-{generation:06d}.safetensors"

    @property
    def backend(self) -> str:
        """Where deltas and global models live: ``file`` (this VM) or ``s3``."""
        return "file" if self.s3 is None else "s3"

    def global_file(self, generation: int) -> tuple[Path, str]:
        """Path and ``algo:hex`` digest of generation ``generation``'s global model."""
        path = self.global_path(generation)
        digest = store.get_meta(self.conn, f"global_digest:{generation}")
        if digest is None:  # written before digests were recorded
            digest = digest_file(path)
        return path, digest

    def _write_generation(
        self,
        generation: int,
        fill: Callable[[Emit], T],
        *,
        momentum: bool,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> tuple[str, T, float]:
        """Generation ``generation``'s files, written as ``fill`` produces its tensors
        (:func:`crossfed.coordinator.generations.write_generation`; ``extra``: the merged
        second-moment factors, at the end of the global model); with an object store the
        global model is written there too before the generation is published."""
        written = write_generation(
            self._master_path(generation),
            self._model_file(generation),
            self.shapes,
            generation,
            fill,
            momentum=momentum,
            extra=extra,
        )
        if self.s3 is not None:
            self.s3.publish_model(self._model_file(generation), generation)
        return written

    def model_download(self, generation: int) -> dict[str, Any]:
        """A presigned URL of generation ``generation``'s global model (object store only)."""
        path, digest = self.global_file(generation)
        assert self.s3 is not None
        return self.s3.model(generation, path, digest)

    def _retain(self, generation: int, closed_round: int) -> None:
        """Retention once generation ``generation`` is committed: keep the last
        ``keep_generations`` generations' masters and ``keep_models`` generations' global
        models, delete the merged rounds' delta blobs (kept with ``keep_deltas``, as is
        generation 0's master), and blobs or partial uploads no delta refers to after
        ``BLOB_GRACE_S``."""
        oldest = {
            "master": generation - max(1, self.keep_generations) + 1,
            "global": generation - self.keep_models + 1 if self.keep_models > 0 else 0,
        }
        if self.keep_models > 0:
            oldest["global"] = min(oldest["global"], oldest["master"])
        for path in self.models_dir.iterdir():
            match = _MODEL_FILE.match(path.name)
            if match is not None:
                kind, generation_of = match.group(1), int(match.group(2))
                replay_start = self.keep_deltas and (kind, generation_of) == ("master", 0)
                if generation_of < oldest[kind] and not replay_start:
                    path.unlink(missing_ok=True)
            elif path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # left by a killed write (this merge is the only one)
        merged, pending = store.delta_blobs(self.conn, closed_round)
        if self.keep_deltas:
            merged, pending = [], [*merged, *pending]
        if self.s3 is not None:
            try:
                deleted = self.s3.prune(merged, pending, oldest["global"], BLOB_GRACE_S)
            except BlobError as exc:  # the generation is committed: retention waits a round
                log.warning("object store retention skipped this round: %s", exc)
                deleted = []
        else:
            deleted = self.blobs.prune(drop=merged, keep=pending, grace_s=BLOB_GRACE_S)
        if deleted:
            with store.Transaction(self.conn):
                store.forget_blob_holders(self.conn, deleted)

    # ------------------------------------------------------------------ reads
    def current_round(self) -> dict[str, Any]:
        """The open round's row."""
        row = store.current_round(self.conn)
        assert row is not None, "a run always has an open round"
        return row

    def round_info(self, round_no: int) -> dict[str, Any]:
        with self.lock:
            self._require_run()
            row = store.round_row(self.conn, round_no)
            if row is None:
                current = self.current_round()["round_no"]
                raise CoordinatorError(
                    404, "unknown_round", f"round {round_no} does not exist (current: {current})"
                )
            row["deltas"] = [
                {k: d[k] for k in ("site", "tokens", "steps", "consumed", "loss", "compute_s")}
                for d in store.round_deltas(self.conn, round_no)
            ]
            return row

    def status(self) -> dict[str, Any]:
        with self.lock:
            spec = self._require_run()
            assert self.book is not None and self.space is not None
            current = self.current_round()
            return {
                "round": current["round_no"],
                "generation": current["generation"],
                "global_step": store.get_meta(self.conn, "global_step", 0),
                "epoch": self.book.epoch,
                "blocks_total": self.space.n_blocks,
                "blocks_committed_in_epoch": self.book.committed_in_epoch,
                "blocks_committed_total": self.book.committed_total,
                "digest": self.space.digest(),
                "model": self._model_view(current["generation"]),
                "inner_steps": spec.inner_steps,
                "schedule": spec.to_dict()["schedule"],
                "outer": spec.to_dict()["outer"],
                "active_leases": [self._lease_view(lease) for lease in self.book.active_leases()],
            }

    def _model_view(self, generation: int) -> dict[str, Any] | None:
        """The global model of ``generation``: its size and digest (a download needs to ask
        no more), or None when either is not at hand."""
        digest = store.get_meta(self.conn, f"global_digest:{generation}")
        if digest is None:
            return None
        try:
            size = self._model_file(generation).stat().st_size
            return {"generation": generation, "bytes": size, "digest": digest}
        except FileNotFoundError:
            return None

    def ledger_table(self) -> list[dict[str, Any]]:
        with self.lock:
            self._require_run()
            assert self.book is not None
            return _ledger_records(self.conn, self.ledger, self.book)

    def delta_site(self, key: str) -> str | None:
        """The site whose accepted delta is blob ``key`` (canonical ``algo:hex``), if any."""
        forms = [key, key.removeprefix("sha256:")]  # SHA-256 keys may be stored bare
        with self.lock:
            return store.delta_owner(self.conn, forms)

    def blob_holders(self, key: str) -> set[str]:
        """Sites that may see blob ``key``: those that uploaded it and the one whose accepted
        delta it is. Empty for a blob no site holds (never uploaded over the API)."""
        key = check_key(key)
        with self.lock:
            holders = store.blob_holders(self.conn, key)
        owner = self.delta_site(key)
        return holders | {owner} if owner is not None else holders

    def hold_blob(self, key: str, site: str) -> None:
        """Record ``site`` as an uploader of blob ``key`` (before its first byte is kept, so a
        restarted coordinator still lets it resume)."""
        key = check_key(key)
        with self.lock, store.Transaction(self.conn):
            store.add_blob_holder(self.conn, key, site)

    def drop_parts(self, parts: list[str], site: str, keep: str) -> list[str]:
        """Delete the parts of a joined upload that only ``site`` holds and no delta refers
        to (not ``keep``, the joined blob); returns the keys deleted."""
        deleted = []
        for part in dict.fromkeys(check_key(p) for p in parts):
            if part == keep or self.blob_holders(part) != {site} or self.delta_site(part):
                continue
            with self.lock, store.Transaction(self.conn):
                self.blobs.delete(part)
                store.forget_blob_holders(self.conn, [part])
            deleted.append(part)
        return deleted

    def _may_use_blob(self, site: str | None, key: str) -> bool:
        """Whether ``site`` (None: the admin) may see or submit blob ``key``."""
        if site is None:
            return True
        holders = self.blob_holders(key)
        return not holders or site in holders

    def sites_view(self) -> list[dict[str, Any]]:
        """Registered sites: ranks, RTT, last step time and when they were last heard from."""
        with self.lock:
            return store.sites(self.conn)

    def round_history(self) -> list[dict[str, Any]]:
        """Closed rounds in order: the merge report's figures and each contributor's loss."""
        with self.lock:
            self._require_run()
            losses = store.delta_losses(self.conn)
            history = []
            for round_no, report in store.closed_reports(self.conn):
                history.append(
                    {
                        "round": round_no,
                        "generation": report.get("generation"),
                        "reason": report.get("reason"),
                        "contributors": report.get("contributors", []),
                        "tokens": report.get("tokens"),
                        "global_step": report.get("global_step"),
                        "loss": report.get("loss"),
                        "merge_s": report.get("merge_s"),
                        "site_loss": losses.get(round_no, {}),
                    }
                )
            return history

    # ------------------------------------------------------------------ sites
    def _check_site(self, site: str) -> RunSpec:
        spec = self._require_run()
        if site not in spec.sites:
            raise CoordinatorError(
                404, "unknown_site", f"site {site!r} is not part of this run ({sorted(spec.sites)})"
            )
        return spec

    def register(
        self, site: str, digest: str, ranks: int, rtt_ms: float | None, round_no: int | None = None
    ) -> dict[str, Any]:
        """A site (re)joins: its block-space digest must match; it adopts the current state."""
        with self.lock:
            spec = self._check_site(site)
            assert self.space is not None
            if digest != self.space.digest():
                raise CoordinatorError(
                    409,
                    "digest_mismatch",
                    f"dataset digest {digest[:16]}... does not match the run's block space "
                    f"{self.space.digest()[:16]}... (N={spec.n_windows}, K={spec.block_size}, "
                    f"seed={spec.data_seed}); prepare the same data with the same settings",
                )
            if ranks < 1:
                raise CoordinatorError(422, "bad_ranks", f"ranks must be >= 1, got {ranks}")
            now = self.clock()
            with self._mutation():
                self._event("register", {"site": site, "now": now})
                store.upsert_site(self.conn, site, ranks, rtt_ms, now)
                if round_no is not None and round_no == self.current_round()["round_no"]:
                    # an announcement: this site means to lease in the open round
                    store.announce_site(self.conn, site, round_no, now)
            return {
                "site": site,
                "n_windows": spec.n_windows,
                "block_size": spec.block_size,
                "data_seed": spec.data_seed,
                "flavour": spec.flavour,
                "vocab_size": spec.vocab_size,
                **self.status(),
            }

    @contextmanager
    def _mutation(self, *, fsync: bool = True) -> Iterator[None]:
        """One SQLite transaction for DARL events and our rows; on failure the in-memory lease
        book is rebuilt from the ledger so it never runs ahead of what is on disk.

        ``fsync=False`` commits with synchronous=NORMAL: the WAL frames reach the OS before
        the reply, so they survive a SIGKILL of the coordinator, but are fsynced only by the
        next fsync'ed commit. Heartbeats use it (a TTL refresh and a progress report); grants
        and commits never do.
        """
        if not fsync:
            store.set_synchronous(self.conn, full=False)
        try:
            with store.Transaction(self.conn):
                yield
        except LeaseError:
            raise  # a refused command leaves the book untouched
        except BaseException:
            assert self.space is not None
            self.book = LeaseBook(self.space.n_blocks)
            self.ledger.replay(self.book)
            raise
        finally:
            if not fsync:
                store.set_synchronous(self.conn, full=True)

    def _event(self, op: str, args: dict[str, Any]) -> Any:
        """Apply one DARL command to the lease book and record it (inside a transaction); every
        ``ledger_checkpoint_every`` events the book is checkpointed, so a restart replays
        only the events since."""
        assert self.book is not None
        result = apply_event(self.book, op, args)
        self.ledger.record(op, args)
        self.ledger.maybe_checkpoint(self.book, self.ledger_checkpoint_every)
        return result

    def _ttl(self, site: str, t_step_s: float | None, rtt_ms: float | None) -> float:
        """TTL = max(min_ttl_s, alpha * t_step + beta_rtt * RTT); initial_ttl_s before the
        site has reported a step time. RTT is the larger of the site's own figure and the
        one this coordinator measured (``_measure_rtt``)."""
        policy = self._require_run().leases
        if not t_step_s:
            return policy.initial_ttl_s
        rtt = max(rtt_ms or 0.0, self._rtt_ms.get(site, 0.0))
        ttl = lease_ttl(t_step_s, rtt / 1000.0, policy.alpha, policy.beta_rtt)
        return max(policy.min_ttl_s, ttl)

    def _echo(self, site: str) -> int:
        """A nonce for the reply; the site returns it with its next heartbeat. A site's last
        ``ECHOES_PER_SITE`` nonces stay good, so heartbeats of its two leases (overlapped
        rounds) do not spoil each other's measurement; each is good for one sample."""
        nonce = secrets.randbits(52)
        sent = self._echoes.setdefault(site, {})
        sent[nonce] = self.monotonic()
        while len(sent) > ECHOES_PER_SITE:
            del sent[next(iter(sent))]  # the oldest
        return nonce

    def _measure_rtt(self, site: str, echo: int | None, held_s: float | None) -> None:
        """RTT as the coordinator sees it, NTP-style: the time from our reply carrying
        ``echo`` to the request returning it, minus the ``held_s`` the site kept it
        (between receiving that reply and sending this request). It covers the network both
        ways plus this server's own queueing, which is what a heartbeat must get through
        within a TTL. Smoothed like TCP's SRTT (weight 1/4 on the new sample)."""
        sent_at = self._echoes.get(site, {}).pop(echo, None) if echo is not None else None
        if sent_at is None or held_s is None:
            return
        sample = (self.monotonic() - sent_at - held_s) * 1000.0
        sample = min(max(sample, 0.0), MAX_RTT_MS)
        old = self._rtt_ms.get(site)
        self._rtt_ms[site] = sample if old is None else 0.75 * old + 0.25 * sample

    def _lease_view(self, lease: Lease) -> dict[str, Any]:
        assert self.space is not None
        blocks = self.space.permutation(lease.epoch)[lease.start : lease.end].tolist()
        return {
            "lease_id": lease.lease_id,
            "site": lease.site,
            "round": lease.round_no,
            "epoch": lease.epoch,
            "blocks": blocks,
            "n_blocks": lease.end - lease.start,
            "consumed": lease.consumed,
            "ttl_s": lease.ttl_s,
            "expires_at": lease.expires_at,
            "status": lease.status,
        }

    def lease(
        self, site: str, round_no: int, n_blocks: int, t_step_s: float | None, rtt_ms: float | None
    ) -> dict[str, Any]:
        """Grant a span of blocks for ``round_no`` (or steal one when the pool is dry).

        ``n_blocks`` is the site's inner phase; the grant is sized by its measured step or
        commit rate (``LeaseBook.grant_size``), so it may be larger or smaller: in a run of
        several sites, a site with neither rate yet gets a probe, ``leases.probe_share`` of it.

        ``round_no`` is the current round or, as an *early lease* (overlapped rounds), the
        next one: the round after the open one, or after the one being merged. An early
        lease only takes from the pool (never steals: with the pool dry the answer is
        ``pool_empty`` and the site waits for its round to open), does not mark a first
        lease on a round that does not exist yet (``_publish`` does when the round opens)
        and does not keep the open round from closing. Every reply carries ``early`` and
        the ``global_step`` the lease's round starts at (for an early lease a forecast
        while the round before is open, see ``next_global_step``).
        """
        with self.lock:
            spec = self._check_site(site)
            assert self.book is not None
            current = self.current_round()
            if self._closing is not None and round_no == self._closing:
                raise CoordinatorError(
                    409,
                    "round_closed",
                    f"round {round_no} is closing (its merge is running); round "
                    f"{round_no + 1} opens when it is done",
                )
            early = round_no == current["round_no"] + 1
            if round_no != current["round_no"] and not early:
                raise CoordinatorError(
                    409,
                    "round_closed" if round_no < current["round_no"] else "round_not_open",
                    f"round {round_no} is not open; the current round is {current['round_no']} "
                    f"(leases are for it or, early, for round {current['round_no'] + 1})",
                )
            if n_blocks < 1:
                raise CoordinatorError(422, "bad_size", f"n_blocks must be >= 1, got {n_blocks}")
            if store.has_delta(self.conn, round_no, site):
                raise CoordinatorError(
                    409,
                    "already_contributed",
                    f"site {site} already contributed to round {round_no}",
                )
            now = self.clock()
            ttl = self._ttl(site, t_step_s, rtt_ms)
            with lease_errors(409):
                size = self.book.grant_size(
                    site, n_blocks, now, live_s=PACE_LIVE_S, max_scale=PACE_MAX_SCALE,
                    step_rates=self._step_rates,
                    probe_share=spec.leases.probe_share if len(spec.sites) > 1 else 1.0,
                )  # fmt: skip
                ranks = store.site_ranks(self.conn, site) or 1
                with self._mutation():
                    args = {"site": site, "now": now, "ttl_s": ttl, "round_no": round_no}
                    lease = self._event(
                        "grant", {**args, "n_blocks": size, "requested": n_blocks, "ranks": ranks}
                    )
                    if lease is None and not early:  # an early lease never steals
                        lease = self._event("steal", {**args, "ranks": ranks})
                    store.site_seen(self.conn, site, now, t_step_s=t_step_s, rtt_ms=rtt_ms)
                    if lease is not None:
                        self._phase_blocks[lease.lease_id] = n_blocks
                    if lease is not None and not early:
                        store.mark_first_lease(self.conn, round_no, now)
            step = current["global_step"]
            if early:
                deltas = store.round_deltas(self.conn, current["round_no"])
                step = next_global_step(step, [d["steps"] for d in deltas], spec.inner_steps)
            reply = {"generation": current["generation"], "early": early, "global_step": step}
            if lease is None:
                return {"lease": None, "reason": "pool_empty", **reply}
            return {"lease": self._lease_view(lease), **reply}

    def heartbeat(
        self,
        lease_id: int,
        site: str,
        consumed: int,
        t_step_s: float | None,
        echo: int | None = None,
        echo_held_s: float | None = None,
    ) -> dict[str, Any]:
        """Refresh a lease's TTL and record progress; the reply shows any steal.

        The reply's ``echo`` nonce comes back with the next heartbeat (with ``echo_held_s``,
        how long the site held it) so the coordinator measures the RTT itself. A heartbeat
        is committed without fsync (``_mutation(fsync=False)``): it survives a SIGKILL, and
        a restart renews every active lease anyway (the ``grace`` event).
        """
        with self.lock:
            self._check_site(site)
            self._measure_rtt(site, echo, echo_held_s)
            now = self.clock()
            ttl = self._ttl(site, t_step_s, store.site_rtt_ms(self.conn, site))
            with lease_errors(409), self._mutation(fsync=False):
                lease = self._event(
                    "heartbeat",
                    {
                        "lease_id": lease_id,
                        "site": site,
                        "consumed": consumed,
                        "now": now,
                        "ttl_s": ttl,
                    },
                )
                store.site_seen(self.conn, site, now, t_step_s=t_step_s)
                self._note_step_rate(site, lease_id, t_step_s)
            return {
                "lease": self._lease_view(lease),
                "round": self.current_round()["round_no"],
                "echo": self._echo(site),
                "rtt_ms": self._rtt_ms.get(site),
            }

    def _note_step_rate(self, site: str, lease_id: int, t_step_s: float | None) -> None:
        """The site's compute rate from a heartbeat's mean step time: the lease's phase (the
        blocks it asked for, H steps' worth) over H steps. Grants are sized by it
        (``LeaseBook.grant_size``): unlike a commit rate it leaves out uploads, merges and
        waits, and it is known from a site's first steps on."""
        blocks = self._phase_blocks.get(lease_id)
        if not t_step_s or not blocks or self.spec is None:
            return
        self._step_rates[site] = blocks / (self.spec.inner_steps * t_step_s)

    def release(self, lease_id: int, site: str) -> dict[str, Any]:
        with self.lock:
            self._check_site(site)
            with lease_errors(409), self._mutation():
                returned = self._event(
                    "release", {"lease_id": lease_id, "site": site, "now": self.clock()}
                )
            return {"lease_id": lease_id, "returned": returned}

    # ------------------------------------------------------------------ deltas
    def submit(
        self,
        *,
        site: str,
        round_no: int,
        lease_id: int,
        generation: int,
        tokens: int,
        steps: int,
        consumed: int,
        blob: str,
        loss: float | None = None,
        compute_s: float | None = None,
        by: str | None = None,
        idle_s: float | None = None,
    ) -> dict[str, Any]:
        """Accept a delta and commit its blocks in ONE transaction; idempotent per lease.

        ``idle_s`` is how long the site held the lease waiting for the previous round's
        merge (an overlapped round's early lease): left out of its pace (DARL's grant sizing).

        ``by`` is the site whose token sent it (None: the admin): a site may submit only a
        blob it uploaded itself; anyone else's is, to it, a blob that does not exist.
        Steps: the numbers, the blob's tensors (outside the lock), the lease and the claim
        (:meth:`_vet`), the blob's verdict, then the commit (:meth:`_record`).
        """
        for name, value in (("loss", loss), ("compute_s", compute_s), ("idle_s", idle_s)):
            if value is not None and not math.isfinite(value):
                raise CoordinatorError(422, "bad_number", f"{name} must be finite, got {value}")
        checked, rejected = self._check_blob_unlocked(blob, by)
        with self.lock:
            vetted = self._vet(site, round_no, lease_id, generation, tokens, steps, consumed, blob)
            if isinstance(vetted, dict):
                return vetted  # the same delta again
            if not self._blob_stored(blob, by) or not self._may_use_blob(by, blob):
                raise CoordinatorError(404, "unknown_blob", f"no blob {blob}; upload it first")
            if not checked:  # it arrived while we were looking
                self._validate_stored(blob, by)
            if rejected is not None:
                raise rejected
            delta = {
                "lease_id": lease_id,
                "round_no": round_no,
                "site": site,
                "generation": generation,
                "tokens": tokens,
                "steps": steps,
                "consumed": consumed,
                "blob": blob,
                "loss": loss,
                "compute_s": compute_s,
            }
            result = self._record(vetted, delta, idle_s or 0.0)
            return {
                "accepted": True,
                "already": False,
                "round": round_no,
                "committed": result.committed,
                "returned": result.returned,
            }

    def _check_blob_unlocked(
        self, blob: str, by: str | None = None
    ) -> tuple[bool, CoordinatorError | None]:
        """Whether the delta check ran, and its refusal if it refused.

        The check reads every tensor: it runs before the lock is taken, so heartbeats and
        grants are not held up; it needs only the master's names and shapes, which never
        change. :meth:`submit` gives its verdict where the lease checks would have reached
        it (a blob not yet stored is checked under the lock instead).
        """
        if not (self._require_run() and self._blob_stored(blob, by)):  # immutable by key
            return False, None
        try:
            self._validate_stored(blob, by)
        except CoordinatorError as exc:
            return True, exc
        return True, None

    def _record(self, lease: Lease, delta: dict[str, Any], idle_s: float = 0.0) -> Any:
        """Commit the lease's first ``consumed`` blocks and record ``delta`` (the deltas row
        without its time) in one transaction; the next epoch starts when this one is done.
        Holds the lock; returns the lease book's commit result."""
        assert self.book is not None and self.space is not None
        now = self.clock()
        site, lease_id, consumed = delta["site"], delta["lease_id"], delta["consumed"]
        self._phase_blocks.pop(lease_id, None)  # committed: no more heartbeats to rate
        try:
            with lease_errors(409), self._mutation():
                args = {"lease_id": lease_id, "site": site, "consumed": consumed, "now": now}
                result = self._event("commit", {**args, "idle_s": idle_s} if idle_s else args)
                blocks = self.space.permutation(lease.epoch)[lease.start : lease.start + consumed]
                self.ledger.record_commit_blocks(lease.epoch, site, lease_id, blocks.tolist())
                store.add_delta(self.conn, **delta, accepted_at=now)
                if self.book.epoch_complete():
                    self._event("next_epoch", {"now": now})
        except LedgerError as exc:
            raise CoordinatorError(409, "duplicate_commit", str(exc)) from exc
        return result

    def vet_delta(
        self,
        *,
        site: str,
        round_no: int,
        lease_id: int,
        generation: int,
        tokens: int,
        steps: int,
        consumed: int,
        blob: str,
    ) -> None:
        """Every check of :meth:`submit` that needs not the blob's bytes, made before an
        inline body is stored: a delta refused here is refused before its first byte is kept."""
        with self.lock:
            self._vet(site, round_no, lease_id, generation, tokens, steps, consumed, blob)

    def _vet(
        self,
        site: str,
        round_no: int,
        lease_id: int,
        generation: int,
        tokens: int,
        steps: int,
        consumed: int,
        blob: str,
    ) -> Lease | dict[str, Any]:
        """The lease behind a delta, checked (owner, round, generation, progress, claim), or
        the answer to a resend of an accepted delta. Refusals change nothing, except that a
        stale delta's lease is released (its blocks return to the pool). A delta for a round
        other than its lease's (``wrong_round``) or for a round not open yet, an early
        lease's (``round_not_open``), leaves the lease as it was. Holds the lock."""
        self._check_site(site)
        assert self.book is not None
        previous = store.delta_of_lease(self.conn, lease_id)
        if previous is not None:
            # a resend after a crash repeats the checkpointed request exactly; anything
            # else on a used lease is a forged or altered replay and changes nothing
            sent = (site, blob, round_no, generation, tokens, steps, consumed)
            if sent != tuple(previous[k] for k in RESEND_FIELDS):
                raise CoordinatorError(
                    409, "lease_used", f"lease {lease_id} already carried a different delta"
                )
            return {"accepted": True, "already": True, "round": previous["round_no"]}
        with lease_errors(404):
            lease = self.book.lease(lease_id)
        if lease.site != site:
            raise CoordinatorError(403, "not_owner", f"lease {lease_id} belongs to another site")
        if lease.round_no != round_no:  # e.g. an early lease's delta sent for the open round
            raise CoordinatorError(
                409,
                "wrong_round",
                f"lease {lease_id} is a lease of round {lease.round_no}, not of round "
                f"{round_no}: refused, the lease is left as it was",
            )
        current = self.current_round()
        if round_no > current["round_no"]:  # an early lease's round, not open yet
            state = "open" if self._closing is None else "closing"
            raise CoordinatorError(
                409,
                "round_not_open",
                f"delta for round {round_no}, which has not opened yet (round "
                f"{current['round_no']} is {state}): refused; lease {lease_id} stays yours, "
                f"submit again once round {round_no} opens",
            )
        if self._closing is not None and round_no == self._closing:
            self._release_quietly(lease_id, site)
            raise CoordinatorError(
                409,
                "stale_generation",
                f"delta for round {round_no}, which is closing (its merge is running; round "
                f"{round_no + 1} follows at generation {current['generation'] + 1}): "
                "rejected, its blocks return to the pool",
            )
        if generation != current["generation"] or round_no != current["round_no"]:
            self._release_quietly(lease_id, site)
            raise CoordinatorError(
                409,
                "stale_generation",
                f"delta trained from generation {generation} for round {round_no}; the current "
                f"round is {current['round_no']} at generation {current['generation']}: "
                "rejected, its blocks return to the pool",
            )
        if tokens < 1 or steps < 1:
            raise CoordinatorError(422, "bad_counts", "tokens and steps must be >= 1")
        if not 1 <= consumed <= lease.end - lease.start:
            raise CoordinatorError(
                422,
                "bad_progress",
                f"consumed={consumed} outside 1..{lease.end - lease.start} for lease {lease_id}",
            )
        self._check_claim(lease, tokens, steps, consumed)
        return lease

    def _check_claim(self, lease: Lease, tokens: int, steps: int, consumed: int) -> None:
        """Tokens and steps no larger than the committed blocks hold: a site trains each
        window once (``seq_len`` tokens of it are predicted) and every inner step trains at
        least one window on each of the ranks the site leased with. The token count is a
        delta's weight in the average and the step count moves the global step, so an
        inflated claim is refused, never capped."""
        spec = self._require_run()
        assert self.space is not None
        windows = claim_windows(self.space, lease, consumed)
        limit = windows * spec.seq_len
        if tokens > limit:
            raise CoordinatorError(
                422,
                "implausible_claim",
                f"tokens={tokens} exceed what the {consumed} committed blocks of lease "
                f"{lease.lease_id} hold: {windows} windows x seq_len {spec.seq_len} = "
                f"{limit} tokens",
            )
        most = -(-windows // lease.ranks)
        if steps > most:
            raise CoordinatorError(
                422,
                "implausible_claim",
                f"steps={steps} exceed what the {windows} windows of the {consumed} committed "
                f"blocks of lease {lease.lease_id} can train on its {lease.ranks} rank(s): "
                f"{most} (every inner step trains at least one window per rank)",
            )

    def _release_quietly(self, lease_id: int, site: str) -> None:
        try:
            with self._mutation():
                self._event("release", {"lease_id": lease_id, "site": site, "now": self.clock()})
        except LeaseError:
            pass

    def _blob_stored(self, blob: str, by: str | None) -> bool:
        """Whether blob ``blob`` is complete: in the file store, or (object store) as an
        object of ``by``'s own (the admin, None: of anyone's) that hashed to its key."""
        if self.s3 is None:
            return self.blobs.exists(blob)
        return self._object_owner(blob, by) is not None

    def _object_owner(self, blob: str, by: str | None) -> str | None:
        """Whose stored object a delta sent by ``by`` refers to (None: none stored)."""
        assert self.s3 is not None
        stored = self.s3.stored(blob)
        if by is not None:
            return by if by in stored else None
        return next(iter(sorted(stored)), None)

    def _validate_stored(self, blob: str, by: str | None) -> None:
        """:meth:`_validate_delta_blob`, on the object store's object when there is one (not
        read again when it passed the check as it was hashed)."""
        if self.s3 is None:
            self._validate_delta_blob(blob)
            return
        owner = self._object_owner(blob, by)
        assert owner is not None
        if self.s3.checked(blob, owner):
            return
        self._validate_delta_tensors(lambda: self.s3.open(blob, owner))  # type: ignore[union-attr]

    def _validate_delta_tensors(self, open_file: Callable[[], TensorFile]) -> None:
        """:meth:`_validate_delta_blob` over a tensor file read in ranges (an object)."""
        try:
            with open_file() as handle:
                validate_delta(self._references(), decoded(handle))
        except DeltaError as exc:
            raise CoordinatorError(422, "bad_delta", f"delta rejected: {exc}") from exc
        except BlobError:
            raise
        except Exception as exc:  # a header that does not parse, a tensor cut short
            raise CoordinatorError(
                422, "bad_delta", f"delta blob is not a readable safetensors file: {exc}"
            ) from exc

    def _validate_delta_blob(self, blob: str) -> None:
        """Decode (any codec) and check a delta against the master before accepting it."""
        path = self.blobs.path(blob)
        try:
            with open_delta(path) as delta:
                validate_delta(self._references(), delta)
        except DeltaError as exc:
            raise CoordinatorError(422, "bad_delta", f"delta rejected: {exc}") from exc
        except Exception as exc:  # safetensors raises its own errors for bad headers
            raise CoordinatorError(
                422, "bad_delta", f"delta blob is not a readable safetensors file: {exc}"
            ) from exc

    # ------------------------------------------------------------------ the clock
    def tick(self) -> dict[str, Any] | None:
        """Expire leases and close the round if the policy says so; returns a merge report."""
        with self.lock:
            if self.spec is None:
                return None
            assert self.book is not None
            now = self.clock()
            next_expiry = self.book.next_expiry()
            if next_expiry is not None and next_expiry <= now:
                with self._mutation():
                    expired = self._event("expire", {"now": now})
                for lease in expired:
                    log.warning(
                        "lease %d of %s expired: %d blocks back to the pool",
                        lease.lease_id,
                        lease.site,
                        lease.end - lease.start,
                    )
            current = self.current_round()
            if self._closing is not None:
                return None  # a merge in another thread is closing this round
            deltas = store.round_deltas(self.conn, current["round_no"])
            active = self.book.active_sites(current["round_no"])
            since = now - self.spec.rounds.join_window_s
            announced = store.announced_sites(self.conn, current["round_no"], since)
            announced -= len(set(active))
            reason = close_decision(
                opened_at=current["opened_at"],
                first_lease_at=current["first_lease_at"],
                now=now,
                deltas=len(deltas),
                active_leases=len(active),
                announced=max(0, announced),
                policy=self.spec.rounds,
                sites_left=len(set(self.spec.sites) - {d["site"] for d in deltas}),
            )
            if reason is None:
                return None
            self._closing = current["round_no"]
            if self.merge_holds_lock:  # the old way, for the benchmark's "before" only
                try:
                    return self._close_round(current, deltas, reason)
                finally:
                    self._closing = None
        try:
            return self._close_round(current, deltas, reason)
        finally:
            with self.lock:
                self._closing = None

    def _close_round(self, current: dict, deltas: list[dict], reason: str) -> dict[str, Any]:
        """Apply Eq. 1 to the round's deltas, persist generation g+1 and open the next round.

        Runs without the lock (``_closing`` names the round meanwhile, so no delta joins
        it and no second merge starts) until the commit. The merge reads generation g's
        files and writes g+1's; nothing in memory changes before the commit, so a merge
        that fails (a full disk, a bad delta, SQLite) leaves the run as it was and the next
        attempt steps from generation g again.
        """
        assert self.spec is not None
        started = self.monotonic()
        generation = current["generation"] + 1
        paths: list[Path | TensorFile] = [self._delta_source(d) for d in deltas]
        tokens = [d["tokens"] for d in deltas]

        def step(emit: Emit) -> OuterStepReport:
            return merge_step(
                self._master_path(current["generation"]), self.shapes, paths, tokens, emit,
                self.spec.outer,
            )  # fmt: skip

        extra = self._merged_moments(deltas, paths, tokens)
        digest, report, checkpoint_s = self._write_generation(
            generation, step, momentum=True, extra=extra
        )
        merge_s = self.monotonic() - started - checkpoint_s
        with self.lock:
            return self._publish(current, deltas, reason, report, digest, merge_s, checkpoint_s)

    def _merged_moments(
        self, deltas: list[dict], paths: list[Path | TensorFile], tokens: list[int]
    ) -> dict[str, torch.Tensor]:
        """The token-weighted mean of the second-moment factors the round's deltas carry,
        for the global model (a run whose ``second_moment`` is ``shared``; else none). A
        site's factors that do not fit the model are left out, and logged."""
        assert self.spec is not None
        if self.spec.second_moment != moments.SHARED:
            return {}
        sent: list[dict[str, torch.Tensor]] = []
        for delta, path in zip(deltas, paths, strict=True):
            if isinstance(path, TensorFile):  # an object: the merge closes it
                factors = decoded(path).moments()
            else:
                with TensorFile(path) as handle:
                    factors = decoded(handle).moments()
            wrong = moments.problem(factors, self.shapes)
            if wrong:
                log.warning("second-moment factors of site %s left out: %s", delta["site"], wrong)
                factors = {}
            sent.append(factors)
        return moments.merge(sent, tokens)

    def _delta_source(self, delta: dict[str, Any]) -> Path | TensorFile:
        """Where the merge reads an accepted delta: its file, or its object in ranges."""
        if self.s3 is None:
            return self.blobs.path(delta["blob"])
        owner = self.s3.owner_for(delta["blob"], delta["site"])
        if owner is None:
            raise CoordinatorError(
                500, "missing_object", f"accepted delta {delta['blob']} has no stored object"
            )
        return self.s3.open(delta["blob"], owner)

    def _publish(
        self,
        current: dict,
        deltas: list[dict],
        reason: str,
        report: OuterStepReport,
        digest: str,
        merge_s: float,
        checkpoint_s: float,
    ) -> dict[str, Any]:
        """Commit generation g+1 (its files are in place) and open the next round."""
        generation = current["generation"] + 1
        assert self.spec is not None and self.book is not None
        steps = [d["steps"] for d in deltas]
        global_step = next_global_step(current["global_step"], steps, self.spec.inner_steps)
        following = current["round_no"] + 1
        now = self.clock()
        summary = {
            "round": current["round_no"],
            "generation": generation,
            "reason": reason,
            "contributors": [d["site"] for d in deltas],
            "tokens": sum(d["tokens"] for d in deltas),
            "shares": report.shares,
            "eta": report.eta_used,
            "global_step": global_step,
            "merge_s": merge_s,
            "checkpoint_s": checkpoint_s,
            "loss": _weighted_loss(deltas),
        }
        with store.Transaction(self.conn):
            store.close_round(self.conn, current["round_no"], now, reason, summary)
            store.set_meta(self.conn, f"global_digest:{generation}", digest)
            store.set_meta(self.conn, "generation", generation)
            store.set_meta(self.conn, "global_step", global_step)
            store.open_round(self.conn, following, generation, now, global_step)
            if self.book.active_sites(following):  # early leases: as if taken at the opening
                store.mark_first_lease(self.conn, following, now)
        self.generation, self.open_round_no = generation, following
        crash_point("after_close_commit")
        self._retain(generation, current["round_no"])
        log.info(
            "round %d closed (%s): %d contributors, %d tokens, generation %d, merge %.2fs",
            current["round_no"],
            reason,
            len(deltas),
            summary["tokens"],
            generation,
            merge_s,
        )
        return summary


def claim_windows(space: BlockSpace, lease: Lease, consumed: int) -> int:
    """Windows in the first ``consumed`` blocks of ``lease`` (the last block may be short)."""
    blocks = space.permutation(lease.epoch)[lease.start : lease.start + consumed]
    last = space.n_blocks - 1
    short = space.block_size - len(space.block_windows(last))
    return consumed * space.block_size - (short if bool((blocks == last).any()) else 0)


def _ledger_records(conn: Any, ledger: LedgerStore, book: LeaseBook) -> list[dict[str, Any]]:
    """Table 3 as JSON records, with ranks and RTT from the sites table."""
    rows = store.sites(conn)
    frame = ledger.table3(
        book, {r["site"]: r["ranks"] for r in rows}, {r["site"]: r["rtt_ms"] for r in rows}
    )
    return json.loads(frame.to_json(orient="records"))


def read_ledger(state_dir: Path) -> list[dict[str, Any]]:
    """Table 3 straight from a coordinator's state directory (no server needed)."""
    path = state_dir / "state.sqlite"
    if not path.exists():
        raise CoordinatorError(404, "no_state", f"no coordinator state at {path}")
    conn = store.connect(path)
    try:
        spec = store.get_meta(conn, "spec")
        if spec is None:
            raise CoordinatorError(409, "no_run", f"{path} holds no run")
        run = RunSpec.from_dict(spec)
        book = LeaseBook(BlockSpace(run.n_windows, run.block_size, run.data_seed).n_blocks)
        ledger = LedgerStore(conn)
        ledger.replay(book)
        return _ledger_records(conn, ledger, book)
    finally:
        conn.close()


def read_status(state_dir: Path) -> dict[str, Any]:
    """What ``GET /v1/status`` answers, straight from a state directory (no server needed).

    Leases are as the ledger last recorded them: a stopped run's in-flight leases show with
    their old expiry times. Opens the database only to read it.
    """
    path = state_dir / "state.sqlite"
    if not path.exists():
        raise CoordinatorError(404, "no_state", f"no coordinator state at {path}")
    conn = store.connect(path)
    try:
        spec = store.get_meta(conn, "spec")
        if spec is None:
            raise CoordinatorError(409, "no_run", f"{path} holds no run")
        run = RunSpec.from_dict(spec)
        space = BlockSpace(run.n_windows, run.block_size, run.data_seed)
        book = LeaseBook(space.n_blocks)
        LedgerStore(conn).replay(book)
        current = store.current_round(conn)
        assert current is not None, f"{path}: a run always has an open round"
        leases = []
        for lease in book.active_leases():
            leases.append(
                {
                    "lease_id": lease.lease_id,
                    "site": lease.site,
                    "round": lease.round_no,
                    "epoch": lease.epoch,
                    "n_blocks": lease.end - lease.start,
                    "consumed": lease.consumed,
                    "ttl_s": lease.ttl_s,
                    "expires_at": lease.expires_at,
                    "status": lease.status,
                }
            )
        return {
            "round": current["round_no"],
            "generation": current["generation"],
            "global_step": store.get_meta(conn, "global_step", 0),
            "epoch": book.epoch,
            "blocks_total": space.n_blocks,
            "blocks_committed_in_epoch": book.committed_in_epoch,
            "blocks_committed_total": book.committed_total,
            "digest": space.digest(),
            "inner_steps": run.inner_steps,
            "schedule": run.to_dict()["schedule"],
            "active_leases": leases,
        }
    finally:
        conn.close()


def _weighted_loss(deltas: list[dict]) -> float | None:
    pairs = [(d["loss"], d["tokens"]) for d in deltas if d["loss"] is not None]
    if not pairs:
        return None
    total = sum(t for _, t in pairs)
    value = sum(loss * t for loss, t in pairs) / total
    return value if math.isfinite(value) else None
