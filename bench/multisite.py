"""The run as sites really run it, end to end: ``tests/e2e/test_multisite.py`` as a benchmark.

One TLS coordinator, two sites (lumi, snellius) with their own checkout copies, tokens,
Snakemake and Slurm 22.05 cluster each; a late join, a ``scancel`` mid-round, an
interrupted and resumed site workflow; then the checks (exact ledger, every round's model
and record at both sites, the same run figures in both reports, nothing of one site at the
other, the same exported model). It takes longer than CI's budget allows (about 10 minutes
on a quiet 2-core machine, 20 under load), so the suite skips it unless
``CROSSFED_MULTISITE=1``; this script sets that and runs it (root and the system packages of
scripts/install-system-deps.sh needed, as for every Slurm test).

The last line printed is one JSON object: ``passed``, ``wall_s`` (the whole pytest run,
clusters included), the test's own timings since the coordinator VM was set up
(``run_created_s``, ``snellius_started_s``, ``scancel_s``, ``snellius_joined_s``,
``lumi_back_s``, ``interrupted_s``, ``snellius_resumed_s``, ``finished_s``, ``checked_s``,
``total_s``), the late join's catch-up (``late_join_catchup_s``: from snellius's start to
the close of the first round its delta went into; ``snellius_started_at_round``, the
coordinator's round when it started, and ``snellius_first_round``, that first round) and
the load average when it ended.

    .venv/bin/python bench/multisite.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timings_of(output: str) -> dict[str, float]:
    """The test's timings line (the last JSON object it printed), or nothing."""
    for line in reversed(output.splitlines()):
        start = line.find('{"')
        if start != -1:
            try:
                return json.loads(line[start:])
            except json.JSONDecodeError:
                continue
    return {}


def main() -> int:
    t0 = time.monotonic()
    # its own base folder: pytest prunes old numbered ones, which others' runs could do to
    # this one's while it runs (short, for the clusters' unix socket paths)
    base = Path(tempfile.gettempdir()) / "crossfed-multisite"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/e2e/test_multisite.py", "-q", "-s", "-p",
         "no:cacheprovider", f"--basetemp={base}"],
        cwd=REPO, env={**os.environ, "CROSSFED_MULTISITE": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    passed = done.returncode == 0 and " passed" in done.stdout
    if not passed:
        print(done.stdout[-12000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
    timings = timings_of(done.stdout)
    if "snellius_joined_s" in timings and "snellius_started_s" in timings:
        timings["late_join_catchup_s"] = round(
            timings["snellius_joined_s"] - timings["snellius_started_s"], 1
        )
    result = {
        "passed": passed,
        "wall_s": round(time.monotonic() - t0, 1),
        **timings,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
