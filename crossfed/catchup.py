"""A site that starts late: its workflow's jobs for rounds the coordinator has already closed.

A site's workflow has a probe, plan, train and merge job for every round of the run; a site
that starts while the coordinator is at round k replays rounds 1..k-1 one after the other.
Each of those jobs asks the coordinator's current round first (one HTTP request, no torch,
no pandas) and, for a closed round, writes a valid record saying so instead of probing,
planning or training, so the site reaches round k while it is still open. A round that is
open (or whose state the coordinator could not tell) runs its jobs as always.

    python -m crossfed.catchup plan --config C --round R --out plan.json    # exit 1: open
    python -m crossfed.catchup probe --config C --round R --out probe.csv
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from crossfed.config import ConfigError, RunConfig, validate_run_config
from crossfed.fileio import write_atomic
from crossfed.sched.columns import PROBE_COLUMNS

log = logging.getLogger(__name__)


#: the exit status of a command whose round is still open (its job then runs as always)
OPEN = 1


def coordinator_round(config: RunConfig, who: str = "admin") -> int | None:
    """The coordinator's current round, or None when it cannot say (unreachable, no run,
    no token): the caller then does the round's work as always."""
    import httpx

    from crossfed.client.reach import EndpointError, coordinator_url, token_for

    try:
        reply = httpx.get(
            f"{coordinator_url(config)}/v1/status",
            headers={"Authorization": f"Bearer {token_for(config, who)}"},
            timeout=30,
        )
        return int(reply.json()["round"]) if reply.status_code == 200 else None
    except (httpx.HTTPError, EndpointError, ValueError, KeyError, TypeError):
        return None


def closed_detail(round_no: int, current: int) -> str:
    return f"round {round_no} closed; coordinator is at round {current}"


def closed_plan(round_no: int, current: int, rounds: int, now: datetime) -> dict[str, Any]:
    """The plan record of a round closed before this site planned it: no site planned.

    Shaped as every plan (crossfed.sched.planner.Plan), mode ``closed``, so the report's
    plan table, the barrier's job log and status read it as they read the others.
    """
    return {
        "created_at": now.isoformat(),
        "mode": "closed",
        "round": round_no - 1,
        "units_total": float(rounds),
        "units_outstanding": float(max(0, rounds - current + 1)),
        "units_per_round": 1.0,
        "tokens_per_unit": 0.0,
        "rounds_remaining": max(0, rounds - current + 1),
        "predicted_finish_s": None,
        "predicted_finish": None,
        "round_ends_s": [],
        "sites": {},
        "detail": f"{closed_detail(round_no, current)}: not planned",
    }


def _read_config(path: str) -> RunConfig:
    """The workflow's effective config (results/.crossfed/config.yaml), typed."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or "coordinator" not in data:
        raise SystemExit(f"crossfed catchup: {path}: not a crossfed run config")
    try:
        return validate_run_config(data, path)[1]
    except ConfigError as exc:
        raise SystemExit(f"crossfed catchup: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Write the closed round's record and exit 0, or exit 1 (``OPEN``) writing nothing."""
    parser = argparse.ArgumentParser(
        prog="python -m crossfed.catchup",
        description="A late site's job for a round the coordinator has closed: write its "
        "record and exit 0;\nexit 1, writing nothing, while the round is open.",
    )
    parser.add_argument("what", choices=["plan", "probe"], help="the job's record to write")
    parser.add_argument("--config", required=True, help="the workflow's effective config")
    parser.add_argument("--round", type=int, required=True, help="the job's round")
    parser.add_argument("--out", required=True, help="plan JSON or probe CSV to write")
    args = parser.parse_args(argv)
    config = _read_config(args.config)
    current = coordinator_round(config)
    if current is None or current <= args.round:
        return OPEN
    out = Path(args.out)
    if args.what == "plan":
        plan = closed_plan(args.round, current, config.rounds, datetime.now(UTC))
        write_atomic(out, json.dumps(plan, indent=2) + "\n")
        print(plan["detail"])
    else:
        write_atomic(out, ",".join(PROBE_COLUMNS) + "\n")
        print(f"{closed_detail(args.round, current)}: not probed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
