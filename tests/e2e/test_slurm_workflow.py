"""End to end on a real Slurm 22.05: the workflow's Slurm profile drives two sites.

The single-host test cluster (tests/helpers/slurm_cluster.py) has two GPU partitions with different
walltime caps; each is one site: ``lumi`` runs 2-minute jobs, ``snellius`` 5-minute ones.
Data preparation and evaluation jobs go to the CPU-only ``small`` partition.
This host is the login node: the embedded coordinator listens on loopback and the Slurm
jobs, which run on the same host, reach it there. The workflow probes both partitions with
``sbatch --test-only``, captures ``sacct`` history for the walltime discount, plans, and the
Slurm executor submits chained training jobs that train rounds back to back. One snellius
job is cancelled mid-round with ``scancel``; later the whole workflow is interrupted
(Ctrl-C, which cancels its Slurm jobs) and run again, and it resumes from the last
completed round. The ledger must stay exact throughout. ``--lint`` and ``--report`` run
on the finished workdir; finally the run is extended by one round (``--config rounds=``),
which the chains' next jobs train without touching anything of the finished rounds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import yaml

from crossfed.darl.ledger import EVENTS_TABLE
from crossfed.report import probe_history
from crossfed.sched.planner import read_plan
from crossfed.sched.probe import read_probes
from crossfed.sched.sacct import parse_sacct
from tests.helpers import workflow
from tests.helpers.slurm_cluster import SlurmTestCluster, slurm_cluster  # noqa: F401 (the session fixture)
from tests.helpers.workflow import (
    BIN,
    REPO,
    background,
    catches_sigint,
    check_ledger,
    finish,
    output_of,
    small_run,
    submitting,
)

#: more rounds than one 2-minute lumi job and snellius alone after it can train before the
#: interrupt: at 8, with rounds of 11-13 s (a site hears of a merge at once), lumi's first job
#: trained 7 and snellius the 8th while lumi's next job was planned, so the Ctrl-C found the
#: run done and the rerun had nothing left to train
ROUNDS = 12
TERMINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
#: waits here poll the test cluster's queue: twice a second
wait_for = functools.partial(workflow.wait_for, poll_s=0.5)


def workdir(tmp_path: Path, cluster: SlurmTestCluster) -> Path:
    """Config, sites and a profile derived from profiles/slurm for the test cluster."""
    (tmp_path / "config").mkdir()
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    small_run(config, ROUNDS, max_windows=32, join_window_s=2)
    # jobs here spend ~30 s starting (two Snakemake parses, torch import) on two cores
    config["chain"] = {"margin_s": 15, "round_prior_s": 10}
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))

    site = dict(ranks=1, micro_batch=4, accumulation=1, rtt_ms=0, scheduler="slurm")
    site.update(account=cluster.account, qos_max_nodes=2, tokens_per_s_per_gpu=1000)
    sites = {
        "lumi": {
            **site,
            "transport": "nat",
            "slowdown": 40.0,
            # each step lasts >= 2.5 s however fast the machine: a round trains >= 15 s, so
            # a 2-minute job (less ~30 s of start-up and the 15-s margin) cannot train all
            "min_step_s": 2.5,
            "max_walltime_h": 10 / 60,
            "shapes": [shape("gcd1-2m", "lumi", "00:02:00")],
        },
        "snellius": {
            **site,
            "transport": "direct",
            "slowdown": 20.0,
            "min_step_s": 1.2,
            "max_walltime_h": 0.5,
            "shapes": [shape("h100-5m", "snellius", "00:05:00")],
        },
    }
    (tmp_path / "config" / "sites.yaml").write_text(yaml.safe_dump({"sites": sites}))

    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    profile.pop("configfiles")  # the site overlay is for real sites
    profile.update(
        {
            "jobs": 8,
            "latency-wait": 5,
            "slurm-init-seconds-before-status-checks": 1,
            "seconds-between-status-checks": 1,
            "default-resources": {
                "slurm_account": cluster.account,
                "slurm_partition": "small",  # data preparation and evaluation
                "runtime": 5,
                "mem_mb": 500,  # test nodes have 1 GB
                "cpus_per_task": 1,
            },
            "set-resources": {"train_job": {"cpus_per_task": 1, "mem_mb": 500}},
            "set-threads": {"train_job": 1, "evaluate": 1},
        }
    )
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "config.yaml").write_text(yaml.safe_dump(profile))
    return tmp_path


def shape(name: str, partition: str, walltime: str) -> dict:
    return {"name": name, "partition": partition, "nodes": 1, "gpus_per_node": 1,
            "walltime": walltime}  # fmt: skip


def snakemake(
    cwd: Path, cluster: SlurmTestCluster, *extra: str, name: str = "snakemake"
) -> subprocess.Popen:
    """The workflow on the test cluster's profile (``cwd/profile``), Ctrl-C-able."""
    env = {**cluster.env, "PATH": f"{BIN}:{cluster.env['PATH']}", "PYTHONUNBUFFERED": "1"}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile", "profile", *extra]
    return background(cmd, cwd, env, cwd / f"{name}.out")


def merged_rounds(results: Path) -> list[int]:
    """The rounds whose merge record the workflow has written."""
    return [r for r in range(1, ROUNDS + 1) if (results / f"rounds/{r}/merge.json").exists()]


def queued(cluster: SlurmTestCluster) -> list[dict[str, str]]:
    """Jobs in the queue: id, partition, state and Snakemake's comment (rule, wildcards)."""
    out = cluster.run("squeue", "-h", "-o", "%i|%P|%T|%k").stdout
    keys = ("id", "partition", "state", "comment")
    return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines()]


def sacct_state(cluster: SlurmTestCluster, job_id: str) -> str:
    out = cluster.run("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State").stdout
    return out.strip().split(" ")[0]


def mid_round(log: Path) -> bool:
    """The chain log shows a lease of round 2 or later: its phase (6 steps of >= 1.2 s) has
    just begun. (A step line can be the phase's last, a second before its delta is in.)"""
    if not log.exists():
        return False
    text = log.read_text()  # an overlapped round's phase starts on an early lease
    return any(
        f"[snellius r{r}] {kind}lease " in text for r in range(2, ROUNDS) for kind in ("", "early ")
    )


def outcomes(results: Path, site: str) -> list[dict]:
    paths = sorted(results.glob(f"sites/{site}/job-*/outcome.json"), key=_job_index)
    return [json.loads(p.read_text()) for p in paths]


def _job_index(path: Path) -> int:
    return int(path.parent.name.split("-")[1])


def fingerprint(results: Path) -> dict[str, str]:
    """Digest of every file the finished rounds and chain jobs left (models, records, plans).

    Not a site's working state (``sites/<site>/state``, its model cache, its lock): that
    rolls on with every round the site trains.
    """
    keep = ("checkpoints", "rounds", ".crossfed/models", "data", "sites/*/job-*")
    files = [p for part in keep for d in results.glob(part) for p in d.rglob("*") if p.is_file()]
    files += [results / "run.json", *results.glob("sites/*/chain-*.json")]
    return {str(p.relative_to(results)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def ledger_events(results: Path) -> list[tuple]:
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        return conn.execute(f"SELECT seq, op, args FROM {EVENTS_TABLE} ORDER BY seq").fetchall()


def stored_spec(results: Path) -> dict:
    """The run spec the coordinator keeps (state.sqlite meta 'spec')."""
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        return json.loads(conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()[0])


def dry_run_outputs(text: str) -> list[str]:
    """The output files of every job a dry run lists."""
    return [f for line in re.findall(r"^\s*output: (.*)$", text, flags=re.M)
            for f in line.split(", ")]  # fmt: skip


def test_two_slurm_sites_chain_jobs_survive_scancel_and_resume(
    tmp_path: Path,
    slurm_cluster: SlurmTestCluster,  # noqa: F811
) -> None:
    cluster = slurm_cluster
    cwd = workdir(tmp_path, cluster)
    results = cwd / "results"
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    # 1. a snellius job is cancelled by Slurm in the middle of a round
    run = snakemake(cwd, cluster)
    log = results / "logs" / "train" / "snellius-job1.log"
    wait_for(lambda: mid_round(log), 600, "snellius training in round 2+", [run])
    victims = [j for j in queued(cluster) if "rule_train_job_wildcards_snellius" in j["comment"]]
    assert len(victims) == 1, queued(cluster)
    cluster.run("scancel", victims[0]["id"])
    timings["to_scancel_s"] = time.monotonic() - t0

    # 2. the workflow carries on: lumi's first job stops before its walltime and the next
    # one is planned and submitted; then, with round 3 merged, the workflow is interrupted
    # (Ctrl-C). Snakemake cancels only the Slurm jobs it has registered: a job whose sbatch
    # is in flight is unknown to it (and the SIGINT hits that sbatch too). So the interrupt
    # waits until Snakemake has logged lumi job 2's Slurm id and runs no submitting sbatch.
    merged = results / "rounds" / "3" / "merge.json"
    lumi_2: list[str] = []

    def ready_to_interrupt() -> bool:
        if not merged.exists():
            return False
        ids = [j["id"] for j in queued(cluster) if j["comment"].endswith("wildcards_lumi_2")]
        lumi_2[:] = ids
        return (
            len(ids) == 1
            and f"submitted with SLURM jobid {ids[0]} (" in output_of(run)
            and not submitting(run.pid)
        )

    wait_for(ready_to_interrupt, 900, "round 3 and lumi job 2 submitted", [run])
    timings["to_interrupt_s"] = time.monotonic() - t0
    # a Snakemake that ignores SIGINT would finish the run and exit 0 (see sigint_default)
    assert catches_sigint(run.pid), "Snakemake does not catch SIGINT: a Ctrl-C cannot stop it"
    merged_then = merged_rounds(results)
    os.killpg(run.pid, signal.SIGINT)
    rc = run.wait(timeout=180)
    assert rc != 0, (
        f"Snakemake exited {rc} after the Ctrl-C; rounds merged at the interrupt {merged_then},"
        f" at the exit {merged_rounds(results)}; its output ends:\n{output_of(run)[-6000:]}"
    )
    wait_for(lambda: not queued(cluster), 60, "Snakemake to cancel its Slurm jobs")
    assert sacct_state(cluster, victims[0]["id"]) == "CANCELLED"
    # the interrupt landed mid-run: Snakemake cancelled lumi job 2, so lumi's chain and the
    # run are unfinished and only the rerun below completes them
    assert cluster.wait_job(lumi_2[0], TERMINAL, 60) == "CANCELLED", output_of(run)[-6000:]
    assert not (results / "sites" / "lumi" / "job-2" / "outcome.json").exists()
    assert not (results / "metrics" / "final.json").exists()
    done_before = {  # rounds whose merge job had finished (their evaluation exists)
        r: (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns
        for r in range(1, ROUNDS + 1)
        if (results / "rounds" / str(r) / "eval.json").exists()
    }
    assert done_before, "no round was complete when the workflow was interrupted"

    # 3. a rerun resumes from the last completed round and finishes the run
    t1 = time.monotonic()
    finish(snakemake(cwd, cluster, name="resume"))
    timings["resume_s"] = time.monotonic() - t1
    for r, mtime in done_before.items():  # closed rounds were not redone
        assert (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns == mtime
    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["rounds"] == ROUNDS
    assert 0 < final["goodput"] < 1  # from the chain jobs' outcomes
    timings["goodput"] = final["goodput"]
    initial = json.loads((results / "rounds" / "0" / "eval.json").read_text())
    assert final["val_perplexity"] < initial["val_perplexity"]
    for r in range(1, ROUNDS + 1):
        info = json.loads((results / "rounds" / str(r) / "merge.json").read_text())
        assert info["status"] == "closed" and info["report"]["generation"] == r

    # the ledger is exact: per-site sums equal the total, no block committed twice, and the
    # cancelled job cost its in-flight lease (returned to the pool when its TTL ran out)
    ledger = check_ledger(results).set_index("site")
    snellius_row = ledger.loc["snellius"]
    assert snellius_row["ttl_expiries"] >= 1 and snellius_row["blocks_lost"] >= 1
    assert (ledger.loc[["lumi", "snellius"], "blocks_committed"] > 0).all()

    # chains: lumi's 2-minute jobs stopped before their walltime and the next job went on;
    # every job that wrote its outcome ended on its own (none was killed at the walltime)
    lumi, snellius = outcomes(results, "lumi"), outcomes(results, "snellius")
    assert lumi[-1]["stopped"] == snellius[-1]["stopped"] == "run_complete"
    assert any(o["stopped"] == "walltime" and o["trained"] >= 1 for o in lumi[:-1]), lumi
    for outcome in lumi + snellius:
        assert sacct_state(cluster, outcome["slurm_job_id"]) == "COMPLETED", outcome
        assert outcome["ended_at"] < outcome["deadline"] - 5, outcome
    # every round merged contributions from the two sites, and each round a job reports as
    # accepted is one whose merge counted that site (a cancelled or interrupted job writes no
    # outcome, so the jobs that did need not cover every round between them)
    contributors = {
        r: json.loads((results / "rounds" / str(r) / "merge.json").read_text())["report"][
            "contributors"
        ]
        for r in range(1, ROUNDS + 1)
    }
    for r, names in contributors.items():
        assert names and set(names) <= {"lumi", "snellius"}, (r, names)
    for site, jobs in (("lumi", lumi), ("snellius", snellius)):
        accepted = {r["round"] for o in jobs for r in o["rounds"] if r["status"] == "accepted"}
        assert accepted, site
        for r in accepted:
            assert site in contributors[r], (site, r, contributors[r])

    # real probes and sacct history fed the plans
    probes = pd.concat(read_probes(p) for p in results.glob("sites/*/job-*/probe.csv"))
    assert set(probes["site"]) == {"lumi", "snellius"} and probes["ok"].all()
    assert (probes["job_id"] != "").all() and (probes["wait_s"] >= 0).all()
    assert len(probe_history(results)) >= len(probes)
    gammas = []
    for plan_path in results.glob("sites/*/job-*/plan.json"):
        plan = read_plan(plan_path)
        assert plan.mode == "queue_aware" and plan.sites["lumi"].submit
        gammas += [sp.gamma for sp in plan.sites.values()]
        sacct = plan_path.with_name("sacct.txt").read_text()
        assert parse_sacct(sacct)  # the real capture parses, pending rows and all
    assert min(gammas) < 1.0  # finished jobs ran shorter than they asked for

    # lint is clean and the report is self-contained
    t2 = time.monotonic()
    lint = subprocess.run(
        [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile", "profile", "--lint"],
        cwd=cwd, env={**cluster.env, "PATH": f"{BIN}:{os.environ['PATH']}"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Congratulations, your workflow is in a good condition" in lint.stdout + lint.stderr
    report = finish(snakemake(cwd, cluster, "--report", "report.zip", name="report"))
    assert zipfile.is_zipfile(cwd / "report.zip"), report
    names = zipfile.ZipFile(cwd / "report.zip").namelist()
    for plot in ("perplexity.png", "perplexity_wallclock.png", "round_time.png"):
        assert any(n.endswith(plot) for n in names), names
    timings["lint_report_s"] = time.monotonic() - t2

    # 4. the finished run is extended by one round: each chain's next job trains round
    # ROUNDS + 1 (their last jobs completed the run) and nothing of rounds 1..ROUNDS changes
    t3 = time.monotonic()
    extend = f"rounds={ROUNDS + 1}"
    before, events_before = fingerprint(results), ledger_events(results)
    last_job = {site: len(outcomes(results, site)) for site in ("lumi", "snellius")}
    dry = finish(snakemake(cwd, cluster, "-n", "--config", extend, name="extend-dry"))
    planned = dry_run_outputs(dry)
    for site, job in last_job.items():
        for name in ("probe.csv", "plan.json", "outcome.json"):
            assert f"results/sites/{site}/job-{job + 1}/{name}" in planned, (site, dry[-6000:])
        assert f"results/sites/{site}/chain-{ROUNDS + 1}.json" in planned, planned
    for name in ("probe.csv", "plan.json", "merge.json", "eval.json"):
        assert f"results/rounds/{ROUNDS + 1}/{name}" in planned, planned
    assert f"results/checkpoints/global-{ROUNDS + 1}.safetensors" in planned, planned
    old_jobs = [f"sites/{s}/job-{j}/" for s, n in last_job.items() for j in range(1, n + 1)]
    done = "|".join(str(r) for r in range(ROUNDS + 1))
    for path in planned:
        assert not re.search(rf"/rounds/({done})/|global-({done})\.", path), path
        assert not any(job in path for job in old_jobs), path
    assert fingerprint(results) == before  # a dry run changes nothing

    finish(snakemake(cwd, cluster, "--config", extend, name="extend"))
    timings["extend_s"] = time.monotonic() - t3
    info = json.loads((results / "rounds" / str(ROUNDS + 1) / "merge.json").read_text())
    assert info["status"] == "closed" and info["report"]["generation"] == ROUNDS + 1, info
    assert info["report"]["contributors"], info
    assert set(info["report"]["contributors"]) <= {"lumi", "snellius"}, info
    after = fingerprint(results)
    assert {k: after.get(k) for k in before} == before  # byte for byte
    events = ledger_events(results)
    assert events[: len(events_before)] == events_before and len(events) > len(events_before)
    config = yaml.safe_load((cwd / "config" / "config.yaml").read_text())
    assert stored_spec(results)["schedule"]["total_steps"] == config["inner"]["steps"] * (
        ROUNDS + 1
    )
    assert json.loads((results / "metrics" / "final.json").read_text())["rounds"] == ROUNDS + 1
    for site, job in last_job.items():  # each chain went on with its next job
        jobs = outcomes(results, site)
        assert len(jobs) > job and jobs[-1]["stopped"] == "run_complete", (site, jobs[job:])
        assert jobs[-1]["next_round"] == ROUNDS + 2, jobs[-1]
    check_ledger(results)
    timings["total_s"] = time.monotonic() - t0
    print(json.dumps({k: round(v, 3) for k, v in timings.items()}))


def test_multi_node_job_starts_one_torchrun_per_node(
    tmp_path: Path,
    slurm_cluster: SlurmTestCluster,  # noqa: F811
) -> None:
    """A two-node allocation: srun starts one torchrun per node, they meet at the head
    node's address (c10d rendezvous), and each starts its ranks (here `crossfed --help`)."""
    script = tmp_path / "launch.py"
    script.write_text(
        "from crossfed.config import load_run_config\n"
        "from crossfed.site.slurm import relaunch_ranks\n"
        "launcher = load_run_config(None, {'launcher': {'command': ''}}).launcher\n"
        "raise SystemExit(relaunch_ranks(4, ['--help'], launcher))\n"
    )
    out = tmp_path / "launch.out"
    job = slurm_cluster.sbatch(
        "-p", "snellius", "-N", "2", "--ntasks=2", "-t", "5", "-o", str(out),
        "--wrap", f"{sys.executable} {script}",
    )  # fmt: skip
    state = slurm_cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    text = out.read_text()
    assert state == "COMPLETED", text
    assert text.count("usage: crossfed") == 4, text  # 2 nodes x 2 ranks
