"""End to end: a finished run is extended, changed and mistyped, as a user would rerun it.

In a copy of the checkout (its ``.venv`` the venv this test runs from, ``PATH`` without it),
the documented command trains one round with the local profile; the extend command of
docs/resume.md with ``rounds=2`` then adds round 2 and leaves every file of round 1 and the
coordinator's ledger as they were, byte for byte. Reruns that would change what round 1
means (other data, a mistyped input, other sites, fewer rounds) are refused when the
workflow is read, with a message, and change nothing at all.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from crossfed.darl.ledger import COMMITTED_TABLE, EVENTS_TABLE
from crossfed.train.schedule import default_warmup_steps
from tests.helpers.workflow import checkout, doc_section, workdir

pytestmark = pytest.mark.slow
USER_PATH = "/usr/bin:/bin"  # a login shell's PATH: no venv on it


def readme_extend_command() -> list[str]:
    """The extend command as docs/resume.md gives it ("Resuming and extending a run")."""
    section = doc_section("# Resuming and extending a run", "docs/resume.md")
    (line,) = re.findall(r"`(\.venv/bin/snakemake --profile profiles/local --config rounds=\d+)`",
                         section)  # fmt: skip
    return shlex.split(line)


def user_checkout(tmp_path: Path) -> Path:
    """The checkout with a small run's config (short rounds, tiny windows)."""
    clone = checkout(tmp_path / "crossfed")
    (tmp_path / "small").mkdir()
    small = workdir(tmp_path / "small", rounds=1)
    for name in ("config.yaml", "sites.yaml"):
        shutil.copy(small / "config" / name, clone / "config" / name)
    return clone


def snakemake(clone: Path, args: list[str], name: str) -> tuple[int, str]:
    """Run a README command (``.venv/bin/snakemake ...``) in the checkout, as a user does."""
    out = clone / f"{name}.out"
    with open(out, "wb") as log:
        rc = subprocess.run(
            args, cwd=clone, env={"PATH": USER_PATH, "HOME": str(clone.parent)},
            stdout=log, stderr=subprocess.STDOUT, timeout=900,
        ).returncode  # fmt: skip
    return rc, out.read_text()


def finish(clone: Path, args: list[str], name: str) -> str:
    rc, out = snakemake(clone, args, name)
    assert rc == 0, out[-6000:]
    return out


def fingerprint(results: Path) -> dict[str, str]:
    """Digest of every file the run's finished rounds left (models, records, data)."""
    keep = ("checkpoints", "rounds", "data", ".crossfed/models")
    files = [p for part in keep for p in (results / part).rglob("*") if p.is_file()]
    files.append(results / "run.json")
    return {str(p.relative_to(results)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def ledger_rows(results: Path) -> tuple[list, list]:
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        events = conn.execute(f"SELECT seq, op, args FROM {EVENTS_TABLE} ORDER BY seq").fetchall()
        committed = conn.execute(f"SELECT * FROM {COMMITTED_TABLE}").fetchall()
    return events, committed


def refused(clone: Path, extend: list[str], *config: str) -> str:
    """A rerun that must stop when the workflow is read; returns what it printed."""
    rc, out = snakemake(clone, [*extend[:-2], "--config", *config], "refused")
    assert rc != 0, out[-4000:]
    assert "Nothing was changed" in out, out[-4000:]
    return out


def test_extend_change_and_mistype_a_finished_run(tmp_path: Path) -> None:
    clone = user_checkout(tmp_path)
    results = clone / "results"
    extend = readme_extend_command()
    assert extend[:3] == [".venv/bin/snakemake", "--profile", "profiles/local"]
    finish(clone, extend[:3], "run")  # the run as configured: one round
    before = fingerprint(results)
    events_before, committed_before = ledger_rows(results)
    assert (results / ".crossfed" / "models" / "global-1.safetensors").exists()
    two_rounds = [*extend[:-1], "rounds=2"]

    # Snakemake's own rerun triggers (params, code, input, mtime) see nothing finished to
    # redo: no finished job's parameters hold the run's length
    # (the profile keeps job banners off the terminal: show them here)
    dry = finish(clone, [*two_rounds, "-n", "--quiet", "host", "--rerun-triggers", "mtime",
                         "params", "input", "software-env", "code"], "dry")  # fmt: skip
    outputs = " ".join(re.findall(r"^\s*output: (.*)$", dry, flags=re.M))
    assert "results/rounds/2/plan.json" in outputs, dry[-4000:]
    for finished in ("rounds/1/plan.json", "rounds/1/merge.json", "global-1.safetensors",
                     "rounds/0/eval.json", "data/meta.json", "run.json"):  # fmt: skip
        assert finished not in outputs, (finished, outputs)
    assert fingerprint(results) == before

    # 1. more rounds: round 2 is added, nothing of round 1 changes
    out = finish(clone, two_rounds, "extend")
    assert "run extended" in out
    after = fingerprint(results)
    assert {k: after[k] for k in before} == before
    assert "checkpoints/global-2.safetensors" in after
    events, committed = ledger_rows(results)
    assert events[: len(events_before)] == events_before
    assert set(committed_before) < set(committed)  # round 1's commits kept, round 2's added
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        spec = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()[0])
    config = yaml.safe_load((clone / "config" / "config.yaml").read_text())
    assert spec["schedule"]["total_steps"] == 2 * config["inner"]["steps"]
    assert config["inner"]["warmup_steps"] is None  # the default: the run's, fixed at its start
    assert spec["schedule"]["warmup_steps"] == default_warmup_steps(config["inner"]["steps"])
    recorded = json.loads((results / "run.json").read_text())["spec"]["schedule"]
    assert recorded["warmup_steps"] == spec["schedule"]["warmup_steps"]
    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["rounds"] == 2
    merge2 = json.loads((results / "rounds" / "2" / "merge.json").read_text())
    assert merge2["report"]["generation"] == 2

    # 2. changes that would give round 1 another meaning are refused, and touch nothing
    before = fingerprint(results)
    events_before, _ = ledger_rows(results)
    shard = clone / "shards" / "c4-train.00000-of-00001.json"
    shard.parent.mkdir()
    shard.write_text(json.dumps({"text": "other data " * 50}) + "\n")
    assert "data.inputs" in refused(clone, extend, f"data={{'inputs': ['{shard}']}}")
    assert "no such file" in refused(clone, extend, f"data={{'inputs': ['{shard}.typo']}}")
    sites = yaml.safe_load((clone / "config" / "sites.yaml").read_text())
    del sites["sites"]["frontier"]
    (clone / "config" / "two-sites.yaml").write_text(yaml.safe_dump(sites))
    out = refused(clone, extend, "rounds=2", "sites_file=config/two-sites.yaml")
    assert "sites.frontier" in out
    assert "closed 2 rounds" in refused(clone, extend, "rounds=1")
    assert fingerprint(results) == before
    assert ledger_rows(results)[0] == events_before

    # 3. the run's own config again: nothing to do
    again = finish(clone, two_rounds, "again")
    assert "Nothing to be done" in again
    assert fingerprint(results) == before
