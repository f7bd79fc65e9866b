"""Benchmark: goodput of the local three-site workflow with overlapped rounds off and on.

Runs ``make run``'s workflow (the local profile, config/config.yaml and config/sites.yaml as
committed) twice, one after the other in fresh run directories, the only difference being
``overlap.enabled``. Goodput is the report's (``final.json`` key ``goodput``): the sites'
accepted compute seconds over the wall seconds of their site jobs, start-up, waits at the
round barrier or for a merge, and the end of the run included.

The last line printed is one JSON object: ``goodput_off`` and ``goodput_on`` (target >= 0.95
with overlap on), their ratio, the held-out perplexity, tokens and training wall-clock of
each run, the overlapped run's perplexity over the plain one's at the end and at matched
tokens (``ppl_on_over_off_matched_tokens``: both at the tokens the shorter run trained,
interpolated between rounds), and per run the mean wait for a merged model
(``merge_wait_s``), the share of phases that folded a merged model in mid-phase or at its
end (``folded_share``) and the perplexity curve (tokens, perplexity per round).

    .venv/bin/python bench/overlap.py                 # about 10 minutes on 2 cores
    .venv/bin/python bench/overlap.py --rounds 12
"""

from __future__ import annotations

import argparse
import json
import math
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


def committed_config() -> dict:
    """config/config.yaml as committed."""
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def run_workflow(root: Path, overlap: dict, rounds: int | None, cores: int | None) -> dict:
    """One local workflow run in ``root`` with these ``overlap`` settings; its figures."""
    config = committed_config()
    config["overlap"] = {**(config.get("overlap") or {}), **overlap}
    if rounds:
        config["rounds"] = rounds
    return run_local_workflow(root, config, f"overlap={overlap}", cores)


def tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a log."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_local_workflow(
    root: Path,
    config: dict,
    what: str,
    cores: int | None = None,
    env: dict | None = None,
    sites: dict | None = None,
) -> dict:
    """The local workflow in ``root`` with ``config`` and ``sites`` (default: the committed
    sites file), extra environment ``env``; its figures. A failed workflow ends the bench
    naming ``what``."""
    (root / "config").mkdir(parents=True)
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    sites_yaml = (
        (REPO / "config" / "sites.yaml").read_text()
        if sites is None
        else yaml.safe_dump(sites, sort_keys=False)
    )
    (root / "config" / "sites.yaml").write_text(sites_yaml)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile",
           str(REPO / "profiles" / "local")]  # fmt: skip
    cmd += ["--cores", str(cores)] if cores else []
    t0 = time.monotonic()
    with open(root / "snakemake.out", "wb") as log:
        done = subprocess.run(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        end = (root / "snakemake.out").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the workflow with {what} failed:\n{end}")
    results = root / "results"
    final = json.loads((results / "metrics" / "final.json").read_text())
    if not (results / "metrics" / "sites.csv").read_text().strip():
        logs = sorted((results / "logs" / "train").glob("*.log")) + [
            results / "logs" / "report.log"
        ]
        tails = "".join(f"\n--- {p}:\n{tail(p)}" for p in logs)
        raise SystemExit(
            f"the workflow with {what} exited 0 but recorded no site's round (an empty"
            f" metrics/sites.csv); its site jobs' and report's logs end:{tails}"
        )
    sites = pd.read_csv(results / "metrics" / "sites.csv")
    accepted = sites[sites["status"] == "accepted"]
    folded = accepted["fold_step"].notna() if "fold_step" in accepted else pd.Series([], bool)
    rounds_csv = pd.read_csv(results / "metrics" / "rounds.csv")
    return {
        "goodput": final["goodput"],
        "curve": [
            [int(t), round(float(p), 2)]
            for t, p in zip(rounds_csv["cum_tokens"], rounds_csv["val_perplexity"], strict=True)
        ],
        "val_perplexity": round(final["val_perplexity"], 2),
        "tokens": final["tokens"],
        "rounds": final["rounds"],
        "training_wall_s": round(final["wall_s"], 1),
        "workflow_s": round(wall, 1),
        "merge_wait_s": round(float(accepted.get("merge_wait_s", pd.Series([0.0])).mean()), 2),
        "folded_share": round(float(folded.mean()), 3) if len(folded) else 0.0,
    }


def perplexity_at(curve: list[list[float]], tokens: float) -> float | None:
    """A run's held-out perplexity at ``tokens`` training tokens, interpolated in log space
    between its rounds (None past its last round)."""
    for (t0, p0), (t1, p1) in zip(curve, curve[1:], strict=False):
        if t0 <= tokens <= t1:
            w = (tokens - t0) / (t1 - t0)
            return math.exp((1 - w) * math.log(p0) + w * math.log(p1))
    return curve[-1][1] if curve and curve[-1][0] == tokens else None


def matched(runs: dict) -> float | None:
    """Overlapped over plain perplexity at the tokens the shorter run trained."""
    tokens = min(runs["off"]["tokens"], runs["on"]["tokens"])
    on, off = (perplexity_at(runs[k]["curve"], tokens) for k in ("on", "off"))
    return round(on / off, 4) if on and off else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default: config.yaml's")
    parser.add_argument("--cores", type=int, default=None, help="default: the profile's")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument(
        "--max-stale",
        type=float,
        default=None,
        help="overlap.max_stale of the overlapped run (default: the config's)",
    )
    parser.add_argument(
        "--rule",
        choices=["rebase", "mix"],
        default=None,
        help="overlap.rule of the overlapped run (default: the config's)",
    )
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    base = Path(args.workdir) if args.workdir else Path(tmp.name)
    runs = {}
    on = {"enabled": True}
    on |= {"max_stale": args.max_stale} if args.max_stale is not None else {}
    on |= {"rule": args.rule} if args.rule else {}
    for name, overlap in (("off", {"enabled": False}), ("on", on)):
        runs[name] = run_workflow(base / f"overlap-{name}", overlap, args.rounds, args.cores)
        print(f"overlap {name}: {json.dumps(runs[name])}", flush=True)
    good_off, good_on = runs["off"]["goodput"], runs["on"]["goodput"]
    print(
        json.dumps(
            {
                "benchmark": "overlap",
                "goodput_off": round(good_off, 4),
                "goodput_on": round(good_on, 4),
                "on_over_off": round(good_on / good_off, 4) if good_off else None,
                "overlap_settings": on,
                "ppl_on_over_off": round(
                    runs["on"]["val_perplexity"] / runs["off"]["val_perplexity"], 4
                ),
                # at matched tokens: each run at the fewer of the two runs' tokens
                "ppl_on_over_off_matched_tokens": matched(runs),
                "target_on": 0.95,
                "off": runs["off"],
                "on": runs["on"],
                "load_average": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
