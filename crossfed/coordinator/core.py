"""The coordinator's shared core: its state, one lock, one transaction per change.

Every state change is written to SQLite (one transaction, :meth:`Core._mutation`) before a
method returns, so whatever a reply promised survives a SIGKILL. One lock serialises
mutations. The model state is on disk, not in memory: each generation's fp32 master and
momentum are one safetensors file read tensor by tensor. The verbs build on this class:
leasing, intake, closing and views (``crossfed.coordinator.service`` joins them).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from crossfed.coordinator import store
from crossfed.coordinator.blobs import BlobStore
from crossfed.coordinator.generations import StateView
from crossfed.coordinator.merger import LocalMerger, Merger, shapes_of
from crossfed.coordinator.objectstore import ObjectStore
from crossfed.coordinator.runspec import RunSpec
from crossfed.coordinator.s3blobs import ObjectBlobs
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import LeaseBook, LeaseError
from crossfed.darl.ledger import CHECKPOINT_EVERY, LedgerStore, apply_event
from crossfed.outer import warm_up
from crossfed.wire.digests import digest_file

log = logging.getLogger("crossfed.coordinator")
#: set to 1, the merge holds the lock that leases and heartbeats wait on from start to commit
#: (how the coordinator merged before): for bench/heartbeat_merge.py's "before" figures only
MERGE_HOLDS_LOCK_ENV = "CROSSFED_MERGE_HOLDS_LOCK"


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


class Core:
    """One run's state on disk and in memory, the lock and the transaction every verb uses."""

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
        merger: Merger | None = None,
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
        self.models_dir = state_dir / "models"
        #: where generations are written and uploads checked: here, or a merge worker
        self.merger: Merger = merger or LocalMerger(self.models_dir, objects)
        #: the object store's blobs and global models (None: the file store, ``self.blobs``)
        self.s3 = None
        if objects is not None:
            self.s3 = ObjectBlobs(
                objects, self.conn, self.lock, lambda: self.shapes or None, self.merger.check
            )
        self.ledger = LedgerStore(self.conn)
        self.spec: RunSpec | None = None
        self.space: BlockSpace | None = None
        self.book: LeaseBook | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}  # the master's tensors, in file order
        self.generation = 0  # the committed generation whose files hold the state
        #: the open round's number, read without the lock (a status long poll): 0 before a run
        self.open_round_no = 0
        self._closing: int | None = None  # the round a merge is closing, outside the lock
        # leasing's measurements since this start (none is on disk)
        self._echoes: dict[str, dict[int, float]] = {}  # site -> {nonce: monotonic at reply}
        self._rtt_ms: dict[str, float] = {}  # RTT the coordinator measured per site (smoothed)
        #: what each lease granted since this start asked for (its site's phase, in blocks)
        self._phase_blocks: dict[int, int] = {}
        #: blocks per second of compute per site, from the step times its heartbeats report
        self._step_rates: dict[str, float] = {}
        #: seconds between a lease's last two heartbeats (its holder's heartbeat period)
        self._beat_gaps: dict[int, float] = {}
        spec = store.get_meta(self.conn, "spec")
        if spec is not None:
            self._load(RunSpec.from_dict(spec))

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
        self._hold_round_clock(store.last_activity(self.conn))
        generation = self._restore_state()
        log.info("loaded run at generation %d (%d ledger events replayed)", generation, replayed)
        params = sum(math.prod(shape) for shape in self.shapes.values())
        threading.Thread(target=warm_up, args=(params,), name="warm-merge", daemon=True).start()

    def _hold_round_clock(self, since: float | None) -> None:
        """The open round's deadline counts only time in which it could be worked on:
        nobody could since ``since`` (the coordinator was down, or the run had ended and is
        now extended), so it comes that much later (the round's recorded opening stays). A
        run resumed or extended after a pause longer than ``rounds.deadline_s`` would
        otherwise close its open round on the first delta to arrive, and every other site's
        delta of it would be stale."""
        current = store.current_round(self.conn)
        if since is None or current is None:
            return
        now = self.clock()
        paused = now - since
        if paused >= 1.0:
            with store.Transaction(self.conn):
                store.hold_round(self.conn, current["round_no"], paused, now)
            log.log(
                logging.INFO if paused >= 60.0 else logging.DEBUG,  # not a restart's seconds
                "round %d: its deadline comes %.0f s later (nobody could work on it meanwhile)",
                current["round_no"], paused,
            )  # fmt: skip

    def _restore_state(self) -> int:
        """The last committed generation and its master's tensor names and shapes (read
        from its file's header: the tensors themselves stay on disk until a merge)."""
        generation = store.get_meta(self.conn, "generation", 0)
        pairs = store.get_meta(self.conn, "shapes")  # None: a run from before they were stored
        self.shapes = self.merger.shapes(generation) if pairs is None else shapes_of(pairs)
        self.generation = generation
        self.open_round_no = self.current_round()["round_no"]
        return generation

    def _require_run(self) -> RunSpec:
        if self.spec is None:
            raise CoordinatorError(409, "no_run", "no run initialised; call POST /v1/run first")
        return self.spec

    def _check_site(self, site: str) -> RunSpec:
        spec = self._require_run()
        if site not in spec.sites:
            raise CoordinatorError(
                404, "unknown_site", f"site {site!r} is not part of this run ({sorted(spec.sites)})"
            )
        return spec

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

    def _event_or_revive(self, op: str, args: dict[str, Any]) -> Any:
        """``op`` (a heartbeat or a commit) on its lease; if the lease's TTL ran out while
        its holder trained on, the lease is first revived (``LeaseBook.revive``) when its
        round is still to be merged and none of its blocks was granted since. Otherwise the
        lease book's refusal of ``op`` stands."""
        assert self.book is not None
        try:
            return self._event(op, args)
        except LeaseError as exc:
            if exc.code != "expired" or not self._round_unmerged(args["lease_id"]):
                raise
            refusal = exc
        beat = {k: args[k] for k in ("lease_id", "site", "consumed", "now", "ttl_s") if k in args}
        try:
            lease = self._event("revive", beat)
        except LeaseError:
            raise refusal from None
        log.info("lease %d of %s lived again when heard from after its TTL: none of its %d "
                 "blocks had been granted since", lease.lease_id, lease.site,
                 lease.n_blocks)  # fmt: skip
        return self._event(op, args) if op != "heartbeat" else lease

    def _round_unmerged(self, lease_id: int) -> bool:
        """Whether ``lease_id``'s round is the open round (not closing) or the next."""
        assert self.book is not None
        round_no = self.book.lease(lease_id).round_no
        return round_no >= self.current_round()["round_no"] and round_no != self._closing

    def current_round(self) -> dict[str, Any]:
        """The open round's row."""
        row = store.current_round(self.conn)
        assert row is not None, "a run always has an open round"
        return row

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

    def _master_path(self, generation: int) -> Path:
        return self.models_dir / f"master-{generation:06d}.safetensors"

    def _model_file(self, generation: int) -> Path:
        """Where generation ``generation``'s bf16 global model is (or will be) written."""
        return self.models_dir / f"global-{generation:06d}.safetensors"

    def global_path(self, generation: int) -> Path:
        """The published bf16 model of ``generation`` (a generation whose merge has not
        committed yet is not published, even if a killed merge left its file behind)."""
        path = self._model_file(generation)
        if generation > store.get_meta(self.conn, "generation", 0) or not path.exists():
            raise CoordinatorError(
                404, "unknown_generation", f"no global model for generation {generation}"
            )
        return path

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

    def model_download(self, generation: int) -> dict[str, Any]:
        """A presigned URL of generation ``generation``'s global model (object store only;
        a merge worker keeps no copy of it on this VM)."""
        assert self.s3 is not None
        digest = store.get_meta(self.conn, f"global_digest:{generation}")
        if generation > store.get_meta(self.conn, "generation", 0) or digest is None:
            _, digest = self.global_file(generation)  # 404, or a run from before digests
        return self.s3.model(generation, self._model_file(generation), digest)

    def model_bytes(self, generation: int) -> int | None:
        """The size of a committed generation's global model (None: not at hand)."""
        size = store.get_meta(self.conn, f"global_bytes:{generation}")
        if size is not None:
            return int(size)
        try:
            return self._model_file(generation).stat().st_size
        except FileNotFoundError:
            return None
