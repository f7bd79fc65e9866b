"""Every benchmark runs: each bench/*.py is started as a user starts it, with its smallest
arguments, and must exit 0 and print one JSON object as its last line holding the keys it
documents. The figures of such small runs mean nothing; a bench that no longer runs (an
import or a signature it uses changed) fails here instead of when someone next measures.

The benches that start whole Snakemake workflows run in tests/e2e/test_bench_smoke_e2e.py;
bench/chaos.py, bench/multisite.py, bench/soak.py and bench/soak_check.py have tests of their
own (ELSEWHERE).
A new bench/*.py needs an entry in SMOKES or WORKFLOW_SMOKES (or ELSEWHERE), or
test_every_bench_has_a_smoke_test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Smoke:
    """One bench's smallest run: its script, its arguments as typed ("{tmp}" stands for the
    test's tmp_path) and keys its documentation names that the last line's JSON object must
    hold."""

    script: str
    args: str
    keys: tuple[str, ...]

    @property
    def name(self) -> str:
        return Path(self.script).stem


SMOKES = [
    Smoke(
        "bench/checkpoint.py",
        "--flavour tiny --repeats 1 --dir {tmp}",
        ("stall_s_foreground", "stall_s_background", "write_s_background", "stall_ratio"),
    ),
    Smoke(
        "bench/compression.py",
        "--params 1000000 --rounds 1 --inner-steps 1 --batch 1 --eval-windows 4",
        ("bytes_ratio_4bit", "loss_rel_diff_4bit"),
    ),
    Smoke(
        "bench/darl_scale.py",
        "--sites 2 --cycles 2 --hb-hz 2 --hb-s 1",
        ("ratio_1e7_vs_1e3", "heartbeats_per_s", "p99_ms"),
    ),
    Smoke(
        "bench/heartbeat_merge.py",
        "--flavour tiny --idle-s 0.5 --join-s 6 --dir {tmp}",
        ("p99_ms_idle", "p99_ms_during_merge", "p99_ms_during_merge_locked", "merge_s_locked"),
    ),
    Smoke(
        "bench/init_memory.py",
        "--flavour tiny --vocab-size 512",
        ("peak_rss_gib_stream", "peak_rss_gib_whole", "ratio"),
    ),
    Smoke(
        "bench/inner_loop.py",
        "--device cpu --seq-len 32 --vocab-size 512 --micro-batch 2 --accumulation 1"
        " --steps 2 --repeats 1",
        ("ratio", "bare_tokens_per_s", "crossfed_tokens_per_s"),
    ),
    Smoke(
        "bench/load.py",
        "--sites 2 --blocks 100 --hb-hz 2 --hb-s 1 --spread-s 0.2",
        ("register", "lease", "heartbeat", "commit", "errors"),
    ),
    Smoke(
        "bench/merge.py",
        "--params 1000000 --repeat 1 --contributors 1 --dir {tmp}",
        ("merge_s", "floor_s", "ratio", "peak_rss_gib", "compute_s_best"),
    ),
    Smoke(
        "bench/objectstore.py",
        "--flavour tiny --sites 1 --streams 1 --store-rtt-ms 3 --workdir {tmp}/objectstore",
        (
            "api_bytes_file",
            "api_bytes_s3",
            "api_ratio",
            "target_met",
            "close_s_file",
            "close_s_s3",
            "process_ratio",
            "process_ratio_worker",
            "worker_store_bytes",
            "close_s_worker",
            "store_rtt_ms",
        ),
    ),  # fmt: skip
    Smoke("bench/planner.py", "", ("plan_s", "target_s", "ratio")),
    Smoke(
        "bench/prepare.py",
        "--copies 1 --shards 2 --jobs 2 --vocab-size 512 --seq-len 32 --repeats 1 --gather-mb 1",
        ("tokens_per_s_per_core", "speedup", "identical", "gather_mb_per_s", "hours_100b"),
    ),
    Smoke(
        "bench/transport.py",
        "--params 1000000 --repeat 1 --part-mb 1 --dir {tmp}",
        ("throughput_ratio", "cpu_efficiency_ratio", "peak_rss_ratio"),
    ),
    Smoke(
        "bench/wan.py",
        "--params 2000000 --payloads 0.6B --links snellius frontier --streams 1 2 --dir {tmp}",
        ("speedup_347ms", "round_s_0.6B_frontier", "round_s_0.6B_snellius", "runs"),
    ),
    Smoke(
        "bench/quality.py",
        "--vocab-size 512 --seq-len 32 --batch 1 --inner-steps 1 2 --steps 2 --seeds 0 "
        "--eval-windows 4 --threads 1 --block-size 4",
        (
            "ratio",
            "block_size",
            "solo_over_centralised",
            "overlap_over_plain",
            "ratio_h1",
            "ratio_h2",
            "solo_h1",
            "solo_h2",
            "floor_h1",
            "outer_run",
        ),  # fmt: skip
    ),
]

#: benches that start whole Snakemake workflows: tests/e2e/test_bench_smoke_e2e.py runs them
WORKFLOW_SMOKES = [
    Smoke(
        "bench/overlap.py",
        "--rounds 1 --workdir {tmp}/runs",
        ("goodput_off", "goodput_on", "ppl_on_over_off_matched_tokens"),
    ),
    Smoke(
        "bench/wan_goodput.py",
        "--rounds 1 --variants wan_n --keep {tmp}/runs",
        ("goodput_local", "goodput_wan_1", "goodput_wan_n", "step_s", "runs"),
    ),
]

#: benches with tests of their own, and those tests
ELSEWHERE = {
    "bench/chaos.py": "tests/e2e/test_chaos_short.py",
    "bench/multisite.py": "tests/e2e/test_multisite.py",
    "bench/soak.py": "tests/e2e/test_soak.py",  # its CI preset, once a session
    "bench/soak_check.py": "tests/e2e/test_soak_check.py",  # on that run's state
}


def _kill_tree(proc: subprocess.Popen) -> None:
    """The bench and everything it started (coordinators, workflow jobs)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    proc.kill()
    proc.communicate()


def run_smoke(smoke: Smoke, tmp_path: Path, timeout_s: float) -> dict:
    """Run ``smoke``'s bench from the repository root as a user would (its scratch files,
    temporary folders included, under ``tmp_path``); its last line's JSON object."""
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in shlex.split(smoke.args)]
    proc = subprocess.Popen(
        [sys.executable, smoke.script, *args],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:  # the timeout, or pytest-timeout's: leave nothing running
        _kill_tree(proc)
        raise
    assert proc.returncode == 0, f"{smoke.script} exited {proc.returncode}:\n{err[-4000:]}"
    lines = out.strip().splitlines()
    assert lines, f"{smoke.script} printed nothing:\n{err[-4000:]}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict), f"{smoke.script}'s last line is not a JSON object"
    missing = [key for key in smoke.keys if key not in result]
    assert not missing, f"{smoke.script}'s JSON lacks {missing}: {lines[-1][:2000]}"
    return result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("smoke", SMOKES, ids=[s.name for s in SMOKES])
def test_bench_runs_with_its_smallest_arguments(smoke: Smoke, tmp_path: Path) -> None:
    run_smoke(smoke, tmp_path, timeout_s=570)


def test_every_bench_has_a_smoke_test() -> None:
    benches = {
        f"bench/{path.name}"
        for path in (REPO / "bench").glob("*.py")
        if not path.name.startswith("_")
    }
    entries = [s.script for s in SMOKES + WORKFLOW_SMOKES]
    assert len(entries) == len(set(entries)), "a bench is listed twice"
    covered = set(entries) | set(ELSEWHERE)
    assert not benches - covered, (
        f"no smoke test runs {sorted(benches - covered)}: add each to SMOKES (or, if it "
        "starts a whole workflow, to WORKFLOW_SMOKES) with its smallest arguments"
    )
    assert not covered - benches, f"entries for benches that are gone: {covered - benches}"
    for script, test in ELSEWHERE.items():
        assert script in (REPO / test).read_text(), f"{test} does not mention {script}"
