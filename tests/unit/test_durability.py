"""A coordinator SIGKILLed at every point of a round comes back consistent from disk.

Real coordinator processes (``tests/conftest.py``): killed from outside after a lease, an
upload, a submit and a merge, and killed from inside (``CROSSFED_CRASH_AT``) in the middle of
a blob upload, after a merge's files are written but before it commits, and after the commit
but before retention. After each restart the generation, the fp32 master and momentum and the
bf16 global model must equal (bitwise) an uninterrupted outer step over the accepted deltas,
the ledger must hold each committed block once, and a site resending gets the same answer.
A merge that fails without a crash (a full disk) leaves the in-memory state as on disk.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crossfed.coordinator.faults import ENV
from crossfed.coordinator.service import Coordinator
from crossfed.outer import outer_step
from crossfed.outer_presets import OuterConfig
from crossfed.wire.codecs import open_delta
from crossfed.wire.digests import digest_file
from crossfed.wire.tensors import StreamWriter
from tests.conftest import LiveCoordinator, staged_delta
from tests.unit.test_coordinator_http import (
    committed_rows,
    delta_file,
    global_model,
    join_and_lease,
    submit,
    wait_round_closed,
)

TOKENS = {"snellius": 240, "lumi": 80}  # 3:1, within what the leases hold


def crash(live: LiveCoordinator, monkeypatch: pytest.MonkeyPatch, at: str | None = None) -> None:
    """SIGKILL the coordinator and start it again (with a crash point armed, if ``at``)."""
    if live.process.poll() is None:
        live.kill()
    if at is not None:
        monkeypatch.setenv(ENV, at)
    live.restart()
    monkeypatch.delenv(ENV, raising=False)


def died_by_its_own_hand(live: LiveCoordinator) -> None:
    assert live.process.wait(timeout=120) == -signal.SIGKILL


def meta(live: LiveCoordinator, key: str) -> str | None:
    with sqlite3.connect(live.state_dir / "state.sqlite") as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def models(live: LiveCoordinator | Coordinator) -> Path:
    return live.state_dir / "models"


def master_of(live: LiveCoordinator, generation: int) -> dict[str, torch.Tensor]:
    return load_file(str(models(live) / f"master-{generation:06d}.safetensors"))


def expected_step(
    master0: dict[str, torch.Tensor], deltas: list[tuple[Path, int]]
) -> dict[str, torch.Tensor]:
    """Master and momentum (``momentum::`` keys) after one uninterrupted outer step."""
    master = {k: v.clone() for k, v in master0.items() if not k.startswith("momentum::")}
    momentum: dict[str, torch.Tensor] = {}
    with ExitStack() as files:
        views = [files.enter_context(open_delta(path)) for path, _ in deltas]
        outer_step(master, momentum, views, [n for _, n in deltas], OuterConfig())
    return {**master, **{f"momentum::{k}": v for k, v in momentum.items()}}


def assert_generation(
    live: LiveCoordinator, generation: int, expected: dict[str, torch.Tensor], tmp: Path
) -> None:
    """The status, the fp32 state on disk and the served bf16 model all match ``expected``."""
    assert live.client().status()["generation"] == generation
    state = master_of(live, generation)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected), "master/momentum differ"
    served = global_model(live, generation, tmp)
    for name, value in served.items():
        assert torch.equal(value, expected[name].to(torch.bfloat16)), name


def assert_ledger_once(live: LiveCoordinator, leases: list[dict]) -> None:
    rows = committed_rows(live)
    assert len(rows) == len({(r[0], r[1]) for r in rows}) == sum(h["n_blocks"] for h in leases)


@pytest.mark.slow
def test_sigkill_after_lease_upload_submit_and_merge(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g0 = global_model(run, 0, tmp_path)
    master0 = master_of(run, 0)
    a, b = join_and_lease(run, "snellius", tiny_data), join_and_lease(run, "lumi", tiny_data)

    crash(run, monkeypatch)  # after the leases: both still held
    held = {lease["lease_id"] for lease in run.client().status()["active_leases"]}
    assert held == {a["lease_id"], b["lease_id"]}

    da = delta_file(tmp_path, g0, seed=1, name="a")
    key = run.client("snellius").upload_blob(da)
    crash(run, monkeypatch)  # after the upload, before the submit: the blob is kept
    assert run.client("snellius").blob_state(key)["complete"]
    first = submit(run, "snellius", a, da, tokens=TOKENS["snellius"])
    assert first["accepted"] and not first["already"]

    crash(run, monkeypatch)  # after the submit: the delta is remembered
    again = submit(run, "snellius", a, da, tokens=TOKENS["snellius"])
    assert again["accepted"] and again["already"]
    assert [d["site"] for d in run.client().round_info(1)["deltas"]] == ["snellius"]
    db = delta_file(tmp_path, g0, seed=2, name="b")
    assert submit(run, "lumi", b, db, tokens=TOKENS["lumi"], inline=True)["accepted"]
    wait_round_closed(run, 1)

    crash(run, monkeypatch)  # after the merge
    expected = expected_step(master0, [(da, TOKENS["snellius"]), (db, TOKENS["lumi"])])
    assert_generation(run, 1, expected, tmp_path / "after")
    assert_ledger_once(run, [a, b])
    for site, lease, path in (("snellius", a, da), ("lumi", b, db)):
        for inline in (False, True):
            assert submit(run, site, lease, path, tokens=TOKENS[site], inline=inline)["already"]


@pytest.mark.slow
def test_sigkill_inside_the_merge_before_its_commit_redoes_it_identically(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g0 = global_model(run, 0, tmp_path)
    master0 = master_of(run, 0)
    a, b = join_and_lease(run, "snellius", tiny_data), join_and_lease(run, "lumi", tiny_data)
    da, db = delta_file(tmp_path, g0, seed=3, name="a"), delta_file(tmp_path, g0, seed=4, name="b")
    assert submit(run, "snellius", a, da, tokens=TOKENS["snellius"])["accepted"]

    crash(run, monkeypatch, at="after_generation_write")
    assert submit(run, "lumi", b, db, tokens=TOKENS["lumi"])["accepted"]
    died_by_its_own_hand(run)  # the round closed, generation 1 is on disk, not committed
    assert meta(run, "generation") == "0"
    half_done = (models(run) / "master-000001.safetensors").read_bytes()

    crash(run, monkeypatch)
    wait_round_closed(run, 1)  # the merge is redone from generation 0 and the same deltas
    expected = expected_step(master0, [(da, TOKENS["snellius"]), (db, TOKENS["lumi"])])
    assert_generation(run, 1, expected, tmp_path / "after")
    assert (models(run) / "master-000001.safetensors").read_bytes() == half_done
    assert_ledger_once(run, [a, b])
    assert submit(run, "lumi", b, db, tokens=TOKENS["lumi"])["already"]


@pytest.mark.slow
def test_sigkill_halfway_through_writing_a_generation_redoes_it_identically(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge streams generation 1 into temp files as it computes it; killed with half
    of its tensors written, the restarted coordinator serves generation 0, and the redone
    merge writes the bytes an uninterrupted one does."""
    g0 = global_model(run, 0, tmp_path)
    master0 = master_of(run, 0)
    a, b = join_and_lease(run, "snellius", tiny_data), join_and_lease(run, "lumi", tiny_data)
    da, db = delta_file(tmp_path, g0, seed=8, name="a"), delta_file(tmp_path, g0, seed=9, name="b")
    assert submit(run, "snellius", a, da, tokens=TOKENS["snellius"])["accepted"]

    crash(run, monkeypatch, at="inside_generation_write")
    assert submit(run, "lumi", b, db, tokens=TOKENS["lumi"])["accepted"]
    died_by_its_own_hand(run)
    assert meta(run, "generation") == "0"
    names = sorted(p.name for p in models(run).iterdir())
    assert "master-000001.safetensors" not in names and "global-000001.safetensors" not in names
    partial = [p for p in models(run).iterdir() if p.name.endswith(".tmp")]
    assert len(partial) == 2 and all(p.stat().st_size > 0 for p in partial)

    log = run.state_dir / "coordinator.log"
    before = log.stat().st_size
    crash(run, monkeypatch)
    wait_round_closed(run, 1)  # redone from generation 0's files and the same deltas
    # the restarted process came up at generation 0 (it may close the round before any
    # request of ours reaches it, so its own log says so) and then redid the merge itself
    restarted = log.read_bytes()[before:].decode()
    assert "loaded run at generation 0 " in restarted, restarted
    loaded = restarted.index("loaded run at generation 0 ")
    assert "round 1 closed" in restarted[loaded:], restarted
    expected = expected_step(master0, [(da, TOKENS["snellius"]), (db, TOKENS["lumi"])])
    assert_generation(run, 1, expected, tmp_path / "after")
    assert not [p for p in models(run).iterdir() if p.name.endswith(".tmp")]  # retention
    assert_ledger_once(run, [a, b])


@pytest.mark.slow
def test_sigkill_after_the_merge_commits_before_retention(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g0 = global_model(run, 0, tmp_path)
    master0 = master_of(run, 0)
    a = join_and_lease(run, "snellius", tiny_data)
    da = delta_file(tmp_path, g0, seed=5, name="a")

    crash(run, monkeypatch, at="after_close_commit")
    assert submit(run, "snellius", a, da, tokens=TOKENS["snellius"])["accepted"]
    died_by_its_own_hand(run)
    assert meta(run, "generation") == "1"
    blob = run.state_dir / "blobs" / "blake3" / digest_file(da).split(":")[1][:2]
    assert any(blob.iterdir())  # retention did not run

    crash(run, monkeypatch)
    expected = expected_step(master0, [(da, TOKENS["snellius"])])
    assert_generation(run, 1, expected, tmp_path / "after")
    assert submit(run, "snellius", a, da, tokens=TOKENS["snellius"])["already"]
    # the next merge's retention removes the round-1 blob the crash left behind
    g1 = global_model(run, 1, tmp_path / "g1")
    c = join_and_lease(run, "lumi", tiny_data, round_no=2)
    dc = delta_file(tmp_path, g1, seed=6, name="c")
    assert submit(run, "lumi", c, dc, generation=1, round_no=2)["accepted"]
    wait_round_closed(run, 2)
    assert not any(blob.iterdir())
    assert_ledger_once(run, [a, c])


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_blob_upload_resumes_it(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g0 = global_model(run, 0, tmp_path)
    a = join_and_lease(run, "snellius", tiny_data)
    da = delta_file(tmp_path, g0, seed=7, name="a")
    part = da.stat().st_size // 3 + 1

    crash(run, monkeypatch, at="after_upload_part")
    client = run.client("snellius", part_bytes=part, retry_budget_s=600)
    offsets: list[str] = []
    client.http.event_hooks["request"] = [
        lambda r: offsets.append(r.url.params.get("offset")) if r.method == "PUT" else None
    ]
    result: dict = {}
    uploader = threading.Thread(target=lambda: result.update(key=client.upload_blob(da)))
    uploader.start()
    died_by_its_own_hand(run)  # the first part is on disk, its reply never went out
    staged = list((run.state_dir / "blobs" / ".uploads").iterdir())
    assert [p.stat().st_size for p in staged] == [part]

    crash(run, monkeypatch)
    uploader.join(timeout=600)
    assert result["key"] == digest_file(da)
    assert offsets.count("0") == 1  # resumed at the first part's end, not sent again
    assert submit(run, "snellius", a, da, tokens=TOKENS["snellius"])["accepted"]
    assert not list((run.state_dir / "blobs" / ".uploads").iterdir())


def test_a_merge_that_fails_before_its_commit_leaves_no_half_step(
    tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = staged_delta(tmp_path / "state", tiny_data, seed=9)
    coord, now, master0, held = staged.coord, staged.now, staged.master0, staged.held
    path, key = staged.path, staged.key
    coord.submit(
        site="lumi", round_no=1, lease_id=held["lease_id"], generation=0, tokens=100, steps=4,
        consumed=held["n_blocks"], blob=key,
    )  # fmt: skip
    write = StreamWriter.write
    calls = [0]

    def disk_full(self: StreamWriter, tensor: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 5:  # a few tensors of generation 1 are already in its temp files
            raise OSError(28, "No space left on device")
        write(self, tensor)

    monkeypatch.setattr(StreamWriter, "write", disk_full)
    now[0] += 60.0
    with pytest.raises(OSError):
        coord.tick()
    assert calls[0] == 5
    assert all(torch.equal(coord.master[k], master0[k]) for k in master0)
    assert coord.momentum == {} and coord.status()["generation"] == 0
    assert sorted(p.name for p in models(coord).iterdir()) == [  # no temp file, no generation 1
        "global-000000.safetensors",
        "master-000000.safetensors",
    ]
    monkeypatch.setattr(StreamWriter, "write", write)
    assert coord.tick()["generation"] == 1  # the retry takes exactly one step
    expected = expected_step({k: v.clone() for k, v in master0.items()}, [(path, 100)])
    assert all(torch.equal(coord.master[k], expected[k]) for k in coord.master)
    assert all(torch.equal(coord.momentum[k], expected[f"momentum::{k}"]) for k in coord.momentum)
    assert len(coord.momentum) == len(coord.master) == len(master0)
