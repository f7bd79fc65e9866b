"""Benchmark: goodput of the local three-site workflow with overlapped rounds off and on.

Runs ``make run``'s workflow (the local profile, config/config.yaml and config/sites.yaml as
committed) twice, one after the other in fresh run directories, the only difference being
``overlap.enabled``. Goodput is the report's (``final.json`` key ``goodput``): the sites'
accepted compute seconds over the wall seconds of their site jobs, start-up, waits at the
round barrier or for a merge, and the end of the run included.

The last line printed is one JSON object: ``goodput_off`` and ``goodput_on`` (target >= 0.95
with overlap on), their ratio, the held-out perplexity, tokens and training wall-clock of
each run, and per run the mean wait for a merged model (``merge_wait_s``) and the share of
phases that folded a merged model in mid-phase or at its end (``folded_share``).

    .venv/bin/python bench/overlap.py                 # about 10 minutes on 2 cores
    .venv/bin/python bench/overlap.py --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_workflow(root: Path, overlap: bool, rounds: int | None, cores: int | None) -> dict:
    """One local workflow run in ``root`` with ``overlap.enabled = overlap``; its figures."""
    (root / "config").mkdir(parents=True)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["overlap"] = {**(config.get("overlap") or {}), "enabled": overlap}
    if rounds:
        config["rounds"] = rounds
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (root / "config" / "sites.yaml").write_text((REPO / "config" / "sites.yaml").read_text())
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile",
           str(REPO / "profiles" / "local")]  # fmt: skip
    cmd += ["--cores", str(cores)] if cores else []
    t0 = time.monotonic()
    with open(root / "snakemake.out", "wb") as log:
        done = subprocess.run(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        tail = (root / "snakemake.out").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the workflow with overlap={overlap} failed:\n{tail}")
    results = root / "results"
    final = json.loads((results / "metrics" / "final.json").read_text())
    sites = pd.read_csv(results / "metrics" / "sites.csv")
    accepted = sites[sites["status"] == "accepted"]
    folded = accepted["fold_step"].notna() if "fold_step" in accepted else pd.Series([], bool)
    return {
        "goodput": final["goodput"],
        "val_perplexity": round(final["val_perplexity"], 2),
        "tokens": final["tokens"],
        "rounds": final["rounds"],
        "training_wall_s": round(final["wall_s"], 1),
        "workflow_s": round(wall, 1),
        "merge_wait_s": round(float(accepted.get("merge_wait_s", pd.Series([0.0])).mean()), 2),
        "folded_share": round(float(folded.mean()), 3) if len(folded) else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default: config.yaml's")
    parser.add_argument("--cores", type=int, default=None, help="default: the profile's")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    base = Path(args.workdir) if args.workdir else Path(tmp.name)
    runs = {}
    for name, overlap in (("off", False), ("on", True)):
        runs[name] = run_workflow(base / f"overlap-{name}", overlap, args.rounds, args.cores)
        print(f"overlap {name}: {json.dumps(runs[name])}", flush=True)
    off, on = runs["off"]["goodput"], runs["on"]["goodput"]
    print(
        json.dumps(
            {
                "benchmark": "overlap",
                "goodput_off": round(off, 4),
                "goodput_on": round(on, 4),
                "on_over_off": round(on / off, 4) if off else None,
                "target_on": 0.95,
                "off": runs["off"],
                "on": runs["on"],
                "load_average": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
