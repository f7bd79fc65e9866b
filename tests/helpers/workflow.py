"""The end-to-end tests' one workflow helper: a small run's directory, the Snakemake workflow
and `crossfed` started as a user starts them, waits that fail with the workflow's output,
the ledger's exactly-once checks, and the commands of the README and the docs pages as a
user types them.

Every local workflow a test starts is recorded, and tests/conftest.py's autouse fixture calls
``reap_workflows()`` after each test: a test that fails mid-run leaves nothing running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import yaml

from crossfed.darl.ledger import COMMITTED_TABLE

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VENV = BIN.parent
#: stand-ins, named as such, for a site's `apptainer` and `module` (tests/helpers/standins)
STANDINS = Path(__file__).resolve().parent / "standins"
BARE_PATH = f"{STANDINS}:/usr/bin:/bin"  # a login shell's PATH with the stand-ins: no venv

#: every local workflow a test started, with its directory: reaped when the test ends
STARTED: list[tuple[subprocess.Popen, Path]] = []


# ------------------------------------------------------------------------- a small run
def small_run(
    config: dict[str, Any],
    rounds: int,
    *,
    steps: int = 6,
    max_windows: int = 64,
    join_window_s: float = 8,
) -> None:
    """Make ``config`` (config/config.yaml's settings) a small run in place: ``rounds``
    short rounds of ``steps`` inner steps over tiny windows, short lease TTLs. The warmup
    stays the config's default (a tenth of a new run's steps, decided by the coordinator)."""
    config.update(rounds=rounds)
    config["data"].update(vocab_size=512, seq_len=32, block_size=4)
    config["inner"].update(steps=steps)
    config["eval"].update(max_windows=max_windows)
    config["round_policy"].update(join_window_s=join_window_s)
    config["darl"].update(min_ttl_s=4, initial_ttl_s=8, heartbeat_s=0.5)


def workdir(tmp_path: Path, rounds: int = 3) -> Path:
    """A run directory (or a site's copy of the checkout) with a small config: short rounds,
    tiny windows."""
    (tmp_path / "config").mkdir(exist_ok=True)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    small_run(config, rounds)
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    for site in sites["sites"].values():
        site["slowdown"] = min(site["slowdown"], 1.5)
    # slow enough to be killed mid-round on any machine: the step-5 log line comes >= 1 s
    # before the last step ends
    sites["sites"]["lumi"].update(slowdown=3.0, min_step_s=1.0)
    (tmp_path / "config" / "sites.yaml").write_text(yaml.safe_dump(sites, sort_keys=False))
    return tmp_path


# ------------------------------------------------------------------------- processes
@contextlib.contextmanager
def sigint_default() -> Iterator[None]:
    """Children started inside begin with SIGINT at its default, as under a terminal.

    A shell script that starts a command in the background (``pytest ... &``, as CI runners
    and batch scripts do) sets SIGINT to ignored; exec keeps an ignored signal ignored, and
    Python then installs no KeyboardInterrupt handler. Snakemake would sleep through the
    test's Ctrl-C, finish the run and exit 0. Exec resets a caught signal to its default, so
    the test process catches SIGINT while it starts the child.
    """
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def background(cmd: list[str], cwd: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """``cmd`` started in a session of its own (Ctrl-C-able, as from a terminal), its output
    in ``log`` (``proc.log_path``)."""
    with sigint_default(), open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def snakemake(
    cwd: Path,
    *extra: str,
    name: str = "snakemake",
    env: dict[str, str] | None = None,
    repo: Path = REPO,
    cores: int = 4,
) -> subprocess.Popen:
    """The workflow of ``repo`` (this checkout, or a site's own copy of it) on its local
    profile in ``cwd``, in the background; reaped at the end."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})}
    cmd = [str(BIN / "snakemake"), "-s", str(repo / "Snakefile"),
           "--profile", str(repo / "profiles" / "local"), "--cores", str(cores),
           *extra]  # fmt: skip
    proc = background(cmd, cwd, env, cwd / f"{name}.out")
    STARTED.append((proc, cwd))
    return proc


def crossfed_cli(
    cwd: Path, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    """One `crossfed` command in ``cwd`` as a person runs it (``token`` as CROSSFED_TOKEN);
    it must succeed."""
    env = {**os.environ, **({"CROSSFED_TOKEN": token} if token is not None else {})}
    done = subprocess.run(
        [str(BIN / "crossfed"), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def output_of(proc: subprocess.Popen) -> str:
    """What a process started by ``background`` printed so far ("" for one without a log)."""
    log = getattr(proc, "log_path", None)
    return log.read_text() if log is not None and log.exists() else ""


def finish(proc: subprocess.Popen, timeout_s: float = 900) -> str:
    """Wait for the workflow; it must succeed. Its output."""
    rc = proc.wait(timeout=timeout_s)
    assert rc == 0, output_of(proc)[-8000:]
    return output_of(proc)


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    procs: Iterable[subprocess.Popen] = (),
    poll_s: float = 0.2,
) -> Any:
    """Until ``predicate()`` holds; returns what it returned. Fails at once, with its output,
    when one of ``procs`` (the workflows being waited on) has ended."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a workflow ended waiting for {what}:\n"
                                     + output_of(proc)[-6000:])  # fmt: skip
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def site_pids(site: str) -> list[int]:
    """The site's loop job (one for the run, every round back to back)."""
    found = subprocess.run(
        ["pgrep", "-f", f"site run .*--site {site} --through-round "],
        capture_output=True,
        text=True,
    )
    return [int(p) for p in found.stdout.split()]


def kill_workflow(proc: subprocess.Popen, cwd: Path) -> None:
    """SIGKILL the whole workflow, its site jobs and the embedded coordinator (a crash)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for site in ("lumi", "snellius", "frontier"):
        for pid in site_pids(site):
            os.kill(pid, signal.SIGKILL)
    endpoint = cwd / "results" / "coordinator" / "endpoint.json"
    if endpoint.exists():  # the embedded coordinator was killed with it or is orphaned
        pid = json.loads(endpoint.read_text())["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap_workflows() -> None:
    """SIGKILL what a test left running (it failed or timed out mid-run): each workflow's
    process group, then whatever still works in its folder (site jobs, the embedded
    coordinator, which runs in a session of its own)."""
    while STARTED:
        proc, cwd = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for entry in Path("/proc").iterdir():  # anything else still working in its folder
            try:
                inside = Path(os.readlink(entry / "cwd")).is_relative_to(cwd)
                if entry.name.isdigit() and inside and int(entry.name) != os.getpid():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def catches_sigint(pid: int) -> bool:
    """The process has a SIGINT handler installed (SigCgt in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


def submitting(pid: int) -> bool:
    """An ``sbatch`` that enqueues a job (not a ``--test-only`` probe) runs under ``pid``."""
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "sbatch" in cmd and "--test-only" not in cmd:
                return True
    return False


# ------------------------------------------------------------------------- what a run left
def log_has_steps(path: Path, round_no: int) -> bool:
    """The site's own step lines ("[lumi r2] step 5 (global ...") show it is mid-phase."""
    site = path.name.split("-")[0]
    return path.exists() and f"[{site} r{round_no}] step " in path.read_text()


def job_times(cwd: Path) -> dict[str, tuple[float, float]]:
    """When each finished job of the workflow in ``cwd`` started and ended, by its rule log
    (``results/logs/...``), from Snakemake's own job records (``.snakemake/metadata``)."""
    times = {}
    for path in (cwd / ".snakemake" / "metadata").rglob("*"):
        if path.is_file():
            record = json.loads(path.read_text())
            for log in record.get("log") or []:
                times[log] = (float(record["starttime"]), float(record["endtime"]))
    return times


def check_ledger(results: Path) -> pd.DataFrame:
    """The run's ``ledger.csv`` (Table 3's columns, the total last) is exact: per-site sums
    equal the total, and no block was committed twice."""
    ledger = pd.read_csv(results / "ledger.csv")
    assert list(ledger.columns) == [
        "site",
        "ranks",
        "rtt_ms",
        "entries",
        "grants",
        "blocks_granted",
        "blocks_committed",
        "blocks_lost",
        "ttl_expiries",
    ]
    assert ledger["site"].iloc[-1] == "total"
    per_site, total = ledger.iloc[:-1], ledger.iloc[-1]
    for column in ("grants", "blocks_granted", "blocks_committed", "blocks_lost", "ttl_expiries"):
        assert per_site[column].sum() == total[column], column
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        rows = conn.execute(f"SELECT epoch, block FROM {COMMITTED_TABLE}").fetchall()
    assert len(rows) == len(set(rows)) == total["blocks_committed"] > 0
    return ledger


# ----------------------------------------------------- the commands of the README and docs pages
#: the page with the real-site steps ("## 1. The coordinator VM", "## 3. Each site")
REAL_SITE = "docs/real-site.md"


def doc_section(heading: str, page: str = "README.md") -> str:
    """The section of ``page`` (a path from the repository root) under ``heading``, a whole
    line such as ``## 3. Each site``, up to the next heading of its level or above; a line
    in a fenced block (a ``# comment`` in a bash block) is no heading."""
    lines = (REPO / page).read_text().splitlines()
    assert heading in lines, f"{page} has no heading {heading!r}"
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end, fenced = len(lines), False
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) ", lines[i])) and len(m.group(1)) <= level:
            end = i
            break
    return "\n".join(lines[start:end]) + "\n"


def bash_blocks(heading: str, page: str = "README.md") -> list[str]:
    """The ```bash blocks of ``page``'s section under ``heading``, as a user reads them."""
    return re.findall(r"```bash\n(.*?)```", doc_section(heading, page), flags=re.S)


def commands(block: str, prefix: str) -> list[str]:
    """The lines of ``block`` that start with ``prefix``, as written (comments and all)."""
    return [line for line in block.splitlines() if line.startswith(prefix)]


def command(block: str, words: str) -> str:
    """The one line of ``block`` that is exactly ``words`` plus, maybe, a comment."""
    (line,) = [
        line for line in block.splitlines() if re.fullmatch(rf"{re.escape(words)}\s*(#.*)?", line)
    ]
    return line


def bash(line: str, cwd: Path, env: dict[str, str], timeout_s: float = 900) -> str:
    """Run one README line with bash, as a user types it; its output (it must succeed)."""
    done = subprocess.run(
        ["/bin/bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, f"{line}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done.stdout + done.stderr


def checkout(dest: Path) -> Path:
    """A clone-like copy of the working tree (tracked and untracked files, links kept)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if name == ".venv":  # a venv linked in (not a folder), which .gitignore's `.venv/` misses
            continue
        source, target = REPO / name, dest / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    (dest / ".venv").symlink_to(VENV)
    return dest


def edit_yaml(path: Path, change: Callable[[Any], None]) -> None:
    """Edit a YAML file as a user does: load, change in place, write back in its order."""
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def stand_in_image(path: Path) -> Path:
    """The stand-in's "image": bin/crossfed records its arguments and runs crossfed."""
    (path / "bin").mkdir(parents=True)
    script = path / "bin" / "crossfed"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {path}/calls.log\n'
        f'exec {VENV / "bin" / "python"} -m crossfed "$@"\n'
    )
    script.chmod(0o755)
    return path
