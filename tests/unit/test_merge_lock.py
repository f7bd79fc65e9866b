"""The coordinator's clocks and its merge's lock, in process: RTT timed by the injected
clock, and the merge leaving the lock free unless ``merge_holds_lock`` (the benchmark's
"before") says otherwise."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from crossfed.coordinator.service import Coordinator
from crossfed.darl.blockspace import BlockSpace
from crossfed.wire.digests import sha256_file
from tests.conftest import tiny_spec


class Clock:
    """A stand-in wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def started(tmp_path: Path, data: Path, clock: Clock, **options) -> Coordinator:
    coordinator = Coordinator(tmp_path / "state", clock=clock, **options)
    spec = tiny_spec(data)
    coordinator.init_run(spec)
    digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
    coordinator.register("snellius", digest, 1, None)
    return coordinator


def test_rtt_is_timed_by_the_injected_clock(tmp_path: Path, tiny_data: Path) -> None:
    clock = Clock()
    coordinator = started(tmp_path, tiny_data, clock)
    held = coordinator.lease("snellius", 1, 1, 0.4, None)["lease"]
    first = coordinator.heartbeat(held["lease_id"], "snellius", 0, 0.4)
    clock.now += 0.5  # the reply took 0.5 s to come back, 0.1 s of it held by the site
    second = coordinator.heartbeat(held["lease_id"], "snellius", 0, 0.4, first["echo"], 0.1)
    assert second["rtt_ms"] == pytest.approx(400.0)


def lock_free(lock: threading.RLock) -> bool:
    """Whether another thread could take ``lock`` now."""
    seen: list[bool] = []

    def probe() -> None:
        if lock.acquire(blocking=False):
            lock.release()
            seen.append(True)
        else:
            seen.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize("holds", [False, True])
def test_the_merge_holds_the_lock_only_when_told_to(
    tmp_path: Path, tiny_data: Path, holds: bool
) -> None:
    clock = Clock()
    coordinator = started(tmp_path, tiny_data, clock, merge_holds_lock=holds)
    held = coordinator.lease("snellius", 1, 1, 0.4, None)["lease"]
    master = load_file(str(coordinator.global_path(0)))
    delta = tmp_path / "delta.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in master.items()}, delta)
    key = "sha256:" + sha256_file(delta)

    async def body() -> AsyncIterator[bytes]:
        yield delta.read_bytes()

    asyncio.run(coordinator.blobs.write_stream(key, body(), 1 << 30))
    accepted = coordinator.submit(
        site="snellius", round_no=1, lease_id=held["lease_id"], generation=0,
        tokens=32, steps=1, consumed=1, blob=key,
    )  # fmt: skip
    assert accepted["accepted"]
    during: list[bool] = []
    merge = coordinator.merger.merge

    def probing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        during.append(lock_free(coordinator.lock))  # the merge is about to read and write
        return merge(*args, **kwargs)

    coordinator.merger.merge = probing  # type: ignore[method-assign]
    clock.now += 60.0  # past the join window
    report = coordinator.tick()
    assert report is not None and report["round"] == 1 and report["generation"] == 1
    assert during == [not holds]
    assert coordinator.current_round()["round_no"] == 2
    assert lock_free(coordinator.lock)
