"""The run's results: final metrics, per-round and per-site tables, the ledger and plots."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from crossfed.darl.ledger import TABLE3_COLUMNS  # noqa: E402
from crossfed.fileio import write_atomic  # noqa: E402
from crossfed.sched.barrier import idle_shares  # noqa: E402

if TYPE_CHECKING:
    from crossfed.config import RunConfig

log = logging.getLogger("crossfed.report")


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def site_table(results: Path) -> pd.DataFrame:
    """One row per (round, site) train job outcome."""
    rows = [_read(p) for p in sorted(results.glob("rounds/*/train/*.json"))]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    keep = [
        "round",
        "site",
        "status",
        "generation",
        "steps",
        "tokens",
        "loss_mean",
        "compute_s",
        "overhead_s",
        "download_s",
        "upload_s",
        "checkpoint_s",
        "tokens_per_s",
        "step_s",
        "mfu",
        "accumulation",
        "ranks",
        "micro_batch",
        "idle_s",
        "idle_share",
        "merge_wait_s",
        "fold_step",
        "comms_hidden_s",
        "comms_exposed_s",
        "blocks_leased",
        "blocks_committed",
        "transport",
        "rtt_ms",
        "detail",
    ]
    frame = idle_shares(frame)  # time each site waited at the round barrier (paper Fig. 2a)
    return frame[[c for c in keep if c in frame]].sort_values(["round", "site"])


def round_table(results: Path, sites: pd.DataFrame) -> pd.DataFrame:
    """One row per closed round: who contributed, loss, held-out perplexity and time split.

    The run's figures come from the coordinator's round records (``merge.json``, kept by
    every site's workflow): contributors, tokens, global step, the round's compute time
    (its slowest accepted delta's inner phase), merge and checkpoint, open and close times.
    So every site's table describes the whole run alike. Comms, the sites' own checkpoints
    and the evaluation are what this workflow's jobs measured (other sites' are private).
    """
    rows = []
    for merge_path in sorted(results.glob("rounds/*/merge.json")):
        info = _read(merge_path)
        report = info["report"]
        round_no = info["round_no"]
        eval_path = results / "rounds" / str(round_no) / "eval.json"
        evaluation = _read(eval_path) if eval_path.exists() else {}
        accepted = (
            sites[(sites["round"] == round_no) & (sites["status"] == "accepted")]
            if not sites.empty
            else sites
        )
        compute_s = info.get("compute_s")  # older records: this workflow's sites only
        if compute_s is None:
            compute_s = float(accepted["compute_s"].max()) if len(accepted) else 0.0
        comms_s = (
            float((accepted["download_s"] + accepted["upload_s"]).mean()) if len(accepted) else 0.0
        )
        site_ckpt_s = float(accepted["checkpoint_s"].mean()) if len(accepted) else 0.0
        eval_s = float(evaluation.get("eval_s", 0.0))
        overhead_s = comms_s + site_ckpt_s + report["merge_s"] + report["checkpoint_s"] + eval_s
        rows.append(
            {
                "round": round_no,
                "generation": report["generation"],
                "contributors": "+".join(report["contributors"]),
                "n_contributors": len(report["contributors"]),
                "close_reason": report["reason"],
                "tokens": report["tokens"],
                "train_loss": report.get("loss"),
                "val_loss": evaluation.get("val_loss"),
                "val_perplexity": evaluation.get("val_perplexity"),
                "global_step": report["global_step"],
                "round_s": (info["closed_at"] or 0) - info["opened_at"],
                "compute_s": compute_s,
                "overhead_s": overhead_s,
                "comms_s": comms_s,
                "merge_s": report["merge_s"],
                "checkpoint_s": report["checkpoint_s"] + site_ckpt_s,
                "eval_s": eval_s,
                "opened_at": info["opened_at"],
                "closed_at": info["closed_at"],
            }
        )
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame = frame.sort_values("round")
        frame["cum_tokens"] = frame["tokens"].cumsum()
        frame["overhead_share"] = frame["overhead_s"] / (frame["compute_s"] + frame["overhead_s"])
        frame["goodput"] = round_goodput(frame, sites)
    return frame


def round_goodput(rounds: pd.DataFrame, sites: pd.DataFrame) -> pd.Series:
    """Per round: this workflow's sites' accepted compute over their site-seconds in the
    round's period (from the previous round's close, or this one's opening, to its close)."""
    if sites.empty or "compute_s" not in sites:
        return pd.Series(float("nan"), index=rounds.index)
    accepted = sites[sites["status"] == "accepted"]
    compute = accepted.groupby("round")["compute_s"].sum()
    count = accepted.groupby("round")["site"].nunique()
    start = rounds["closed_at"].shift(1).fillna(rounds["opened_at"])
    period = (rounds["closed_at"] - start).where(lambda s: s > 0)
    by_round = rounds["round"]
    return by_round.map(compute) / (by_round.map(count) * period)


def site_jobs(results: Path) -> list[dict[str, Any]]:
    """Every site job's outcome: the local profile's one per run length, a chain's per job."""
    paths = sorted(results.glob("sites/*/chain-*.json"))
    paths += sorted(results.glob("sites/*/job-*/outcome.json"))
    return [_read(p) for p in paths]


def goodput(jobs: list[dict[str, Any]]) -> float | None:
    """The run's goodput: the sites' accepted compute seconds over their jobs' wall seconds
    (start-up, waits at the barrier or for a merge, and the end included). None without
    jobs that record their compute."""
    timed = [j for j in jobs if "compute_s" in j and j.get("ended_at") and j.get("started_at")]
    wall = sum(float(j["ended_at"]) - float(j["started_at"]) for j in timed)
    if not timed or wall <= 0:
        return None
    return sum(float(j["compute_s"]) for j in timed) / wall


def plot_goodput(rounds: pd.DataFrame, run_goodput: float | None, path: Path) -> Path:
    """Per round, the share of the sites' time spent computing; the run's goodput beside it."""
    fig, ax = plt.subplots(figsize=(6, 4.6))
    if "goodput" in rounds:
        ax.bar(rounds["round"], rounds["goodput"], color="#1f77b4", label="round: compute share")
    if run_goodput is not None:
        ax.axhline(run_goodput, color="black", linestyle="--",
                   label=f"run goodput {run_goodput:.3f} (site jobs)")  # fmt: skip
    ax.axhline(0.95, color="#2ca02c", linestyle=":", label="target 0.95")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("outer round")
    ax.set_ylabel("compute seconds / site seconds")
    ax.set_xticks(rounds["round"].tolist())
    ax.set_title("crossfed: goodput")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize="small",
              frameon=False)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def contributions(results: Path, site_names: list[str]) -> dict[str, int]:
    """Rounds each site contributed to, from the coordinator's round records (every site's
    accepted deltas, not only this workflow's jobs)."""
    counts = dict.fromkeys(site_names, 0)
    for merge_path in results.glob("rounds/*/merge.json"):
        for site in set(_read(merge_path)["report"]["contributors"]):
            counts[site] = counts.get(site, 0) + 1
    return counts


def check_ledger(ledger: pd.DataFrame) -> None:
    """The paper's Table 3 identity: per-site columns sum to the total row."""
    per_site, total = ledger[ledger["site"] != "total"], ledger[ledger["site"] == "total"]
    if len(total) != 1:
        raise ValueError("ledger has no single 'total' row")
    for column in ("grants", "blocks_granted", "blocks_committed", "blocks_lost", "ttl_expiries"):
        if int(per_site[column].sum()) != int(total[column].iloc[0]):
            raise ValueError(
                f"ledger column {column}: sites sum to {per_site[column].sum()}, "
                f"total says {total[column].iloc[0]}"
            )


def missing_site_records(sites: pd.DataFrame, ledger: pd.DataFrame, results: Path) -> str | None:
    """What to say when no site job's round record is in ``results`` although the ledger
    counts committed blocks (the records deleted, or another run's folder); None otherwise."""
    committed = int(ledger.loc[ledger["site"] == "total", "blocks_committed"].sum())
    if not sites.empty or committed == 0:
        return None
    return (
        f"no site round records in {results / 'rounds'}/*/train/ although the ledger counts "
        f"{committed} committed blocks: metrics/sites.csv and the per-site figures are empty "
        "(were the records deleted, or is this another run's results folder?)"
    )


def plot_perplexity(rounds: pd.DataFrame, initial: dict[str, Any], path: Path) -> Path:
    """Held-out perplexity against training tokens (paper Fig. 1a)."""
    tokens = [0] + rounds["cum_tokens"].tolist()
    ppl = [initial["val_perplexity"]] + rounds["val_perplexity"].tolist()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, ppl, marker="o", label="global model (held-out)")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (all sites)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("crossfed: perplexity vs tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: A gap this long between a round closing and the workflow probing the next one is a
#: stopped workflow (an extended or resumed run), not the run: a running workflow probes
#: as its next job. The wall-clock plot leaves such gaps out.
IDLE_GAP_S = 60.0
#: The parts of a round, open to close, in time order: (column, label, colour).
ROUND_PARTS = [
    ("until_probe_s", "round open until probed (merge job, workflow stopped)", "#bbbbbb"),
    ("startup_s", "probe, plan, site jobs starting", "#9467bd"),
    ("compute_in_round_s", "compute (slowest site)", "#1f77b4"),
    ("comms_in_round_s", "comms (weights down + delta up)", "#ff7f0e"),
    ("checkpoint_in_round_s", "checkpoints (sites + coordinator)", "#2ca02c"),
    ("merge_in_round_s", "merge (outer step)", "#d62728"),
    ("other_s", "other (join window, barrier, stragglers)", "#8c564b"),
]
#: the measured parts, in the order a round's period is given to them (``round_phases``)
MEASURED_PARTS = ("compute_s", "comms_s", "checkpoint_s", "merge_s")


def round_phases(rounds: pd.DataFrame, results: Path) -> pd.DataFrame:
    """``rounds`` with the parts of every round's ``round_s`` named (``ROUND_PARTS``, which sum
    to ``round_s``) and ``idle_s``, the time the workflow was stopped inside the round.

    The measured parts (``MEASURED_PARTS``) are the slowest site's and the coordinator's
    seconds; with overlapped rounds some of them ran before the round opened (a phase
    starts in the period of the round before). Their ``*_in_round_s`` columns take what
    fits in the round's period after start-up, in order, so the parts never sum past it;
    ``other_s`` is what is left."""
    if rounds.empty:
        return rounds
    frame = rounds.copy()
    probed, first_lease = [], []
    for _, row in frame.iterrows():
        merge = results / "rounds" / str(int(row["round"])) / "merge.json"
        info = _read(merge) if merge.exists() else {}
        first_lease.append(info.get("first_lease_at") or row["opened_at"])
        probe = results / "rounds" / str(int(row["round"])) / "probe.csv"
        when = None
        if probe.exists():
            times = pd.read_csv(probe)["probed_at"]
            if len(times):
                when = pd.to_datetime(times, utc=True, format="ISO8601").min().timestamp()
        probed.append(when if when is not None else row["opened_at"])
    opened, closed = frame["opened_at"], frame["closed_at"]
    # a chained site leases as soon as a round opens, before the workflow's probe of it:
    # the round's start-up ends at its first lease, whichever came first
    lease_at = pd.Series(first_lease, index=frame.index).clip(lower=opened, upper=closed)
    probed_at = pd.Series(probed, index=frame.index).clip(lower=opened, upper=lease_at)
    frame["until_probe_s"] = probed_at - opened
    frame["startup_s"] = lease_at - probed_at
    left = (frame["round_s"] - frame["until_probe_s"] - frame["startup_s"]).clip(lower=0.0)
    for column in MEASURED_PARTS:
        part = frame[column].fillna(0.0).clip(lower=0.0, upper=left)
        frame[column.removesuffix("_s") + "_in_round_s"] = part
        left = left - part
    frame["other_s"] = left
    frame["idle_s"] = frame["until_probe_s"].where(frame["until_probe_s"] > IDLE_GAP_S, 0.0)
    return frame


def plot_round_time(rounds: pd.DataFrame, path: Path) -> Path:
    """Every round's wall-clock, open to close, split into named parts (paper Table 1, Fig. 2b)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = pd.Series(0.0, index=rounds.index)
    for column, label, colour in ROUND_PARTS:
        if column in rounds:
            ax.bar(rounds["round"], rounds[column], bottom=bottom, label=label, color=colour)
            bottom = bottom + rounds[column]
    if "round_s" in rounds:
        ax.scatter(
            rounds["round"],
            rounds["round_s"],
            marker="_",
            s=300,
            color="black",
            label="round_s (open to close)",
            zorder=3,
        )
    ax.set_xlabel("outer round")
    ax.set_ylabel("seconds")
    ax.set_xticks(rounds["round"].tolist())
    ax.set_title("crossfed: where each round's wall-clock went")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_perplexity_wallclock(rounds: pd.DataFrame, initial: dict[str, Any], path: Path) -> Path:
    """Held-out perplexity against connected wall-clock time (paper Fig. 1b): the time the
    workflow was stopped (``idle_s``, between invocations) is left out."""
    start = float(rounds["opened_at"].min()) if len(rounds) else 0.0
    idle = rounds["idle_s"].cumsum() if "idle_s" in rounds else 0.0
    hours = [0.0] + ((rounds["closed_at"] - start - idle) / 3600.0).tolist()
    ppl = [initial["val_perplexity"]] + rounds["val_perplexity"].tolist()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hours, ppl, marker="o", label="global model (held-out)")
    ax.set_yscale("log")
    ax.set_xlabel("connected wall-clock hours since round 1 opened")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("crossfed: perplexity vs wall-clock")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


PLAN_COLUMNS = ["plan", "site", "submit", "shape", "jobs", "accumulation", "gamma", "wait_s"]
PLAN_COLUMNS += ["predicted_start", "predicted_finish", "reason"]


def plan_table(results: Path) -> pd.DataFrame:
    """Every plan the run made, one row per site: the round plans and each chain job's."""
    found = [(f"round {p.parent.name}", p) for p in results.glob("rounds/*/plan.json")]
    found += [
        (f"{p.parent.parent.name} {p.parent.name}", p)
        for p in results.glob("sites/*/job-*/plan.json")
    ]
    rows = []
    for name, path in sorted(found, key=lambda item: item[1].stat().st_mtime):
        for site, entry in _read(path).get("sites", {}).items():
            rows.append({"plan": name, "site": site, **entry})
    if not rows:  # every round closed before its plan ran ("not planned"): a header, no rows
        return pd.DataFrame(columns=PLAN_COLUMNS)
    frame = pd.DataFrame(rows)
    return frame[[c for c in PLAN_COLUMNS if c in frame]]


CHAIN_COLUMNS = ["site", "job", "slurm_job_id", "rounds_trained", "stopped", "seconds", "left_s"]
CHAIN_COLUMNS += ["next_job", "detail"]


def chain_table(results: Path) -> pd.DataFrame:
    """One row per chained Slurm job: its rounds, why it stopped, and whether a next followed."""
    rows = []
    for path in results.glob("sites/*/job-*/outcome.json"):
        out = _read(path)
        rounds = [r["round"] for r in out.get("rounds", []) if r.get("status") == "accepted"]
        rows.append(
            {
                "site": out["site"],
                "job": int(path.parent.name.split("-")[1]),
                "slurm_job_id": out.get("slurm_job_id"),
                "rounds_trained": " ".join(map(str, rounds)),
                "stopped": out["stopped"],
                "seconds": round(out.get("ended_at", 0.0) - out.get("started_at", 0.0), 1),
                "left_s": (
                    round(out["deadline"] - out["ended_at"], 1) if out.get("deadline") else None
                ),
                "next_job": out.get("next_job"),
                "detail": out.get("detail", ""),
            }
        )
    frame = pd.DataFrame(rows, columns=CHAIN_COLUMNS)
    return frame.sort_values(["site", "job"])


def probe_history(results: Path) -> pd.DataFrame:
    """Every probe the workflow made: the round probes' and each chained job's history."""
    from crossfed.sched.probe import read_probes

    frames = [read_probes(p) for p in sorted(results.glob("probes/history*.csv"))]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(frame):  # a header repeated by concurrent first appends is not a probe
        frame = frame[frame["probed_at"] != "probed_at"]
    return frame


def plot_probe_history(history: pd.DataFrame, path: Path) -> Path:
    """Predicted queue wait of every probed shape over time (sbatch --test-only)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    frame = history[history["ok"]] if len(history) else history
    shown = False
    if len(frame):
        frame = frame.assign(
            probed_at=pd.to_datetime(frame["probed_at"], utc=True, format="ISO8601")
        )
        for (site, shape), rows in frame.groupby(["site", "shape"]):
            rows = rows.sort_values("probed_at")  # histories of several jobs interleave
            ax.plot(rows["probed_at"], rows["wait_s"] / 60.0, marker=".", label=f"{site} {shape}")
            shown = True
    if shown:
        ax.set_xlabel("probed at (UTC)")
        ax.set_ylabel("predicted wait (minutes)")
        ax.legend(fontsize="small")
        fig.autofmt_xdate()
    else:
        ax.text(0.5, 0.5, no_probes_reason(history), ha="center", va="center", wrap=True)
        ax.set_axis_off()
    ax.set_title("queue probes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def no_probes_reason(history: pd.DataFrame) -> str:
    """Why the probe plot has no line: no probe ran, or what every probe answered."""
    if history.empty:
        return "no scheduler probes were made"
    reasons = sorted(set(history["reason"].astype(str)))
    if reasons == ["no_scheduler"]:
        return (
            "no queue waits to show: no site of this run has a batch\n"
            "scheduler (local profile), so every job starts at once"
        )
    return "no probe got a start time from its scheduler\n(reasons: " + ", ".join(reasons) + ")"


TABLE_CSS = """<style>
body { font-family: sans-serif; font-size: 13px; margin: 8px; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; position: sticky; top: 0; }
tr:nth-child(even) td { background: #fafafa; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
</style>"""


def table_html(frame: pd.DataFrame, title: str, csv_name: str, path: Path) -> Path:
    """A table as a standalone HTML page (the report shows it inline; the CSV stays beside)."""
    body = frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0)
    if frame.empty:  # the columns still say what would be there
        body += "<p>(no rows)</p>"
    html = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>{TABLE_CSS}"
        f"</head><body><p><b>{title}</b> ({len(frame)} rows; CSV: <code>{csv_name}</code>)</p>"
        f"{body}</body></html>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path


def write_report(
    config: RunConfig,
    site_names: list[str],
    results: Path,
    ledger_records: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write metrics/final.json, metrics/rounds.csv, metrics/sites.csv, ledger.csv, plots and
    the tables as HTML pages (``report/``); the ledger from the running coordinator unless
    ``ledger_records`` (e.g. read from a stopped coordinator's state) are given."""
    from crossfed.client.reach import client_for

    metrics = results / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    sites = site_table(results)
    rounds = round_phases(round_table(results, sites), results)
    initial = _read(results / "rounds" / "0" / "eval.json")
    if ledger_records is None:
        ledger_records = client_for(config, "admin").ledger()
    ledger = pd.DataFrame(ledger_records)[list(TABLE3_COLUMNS)]
    check_ledger(ledger)
    missing = missing_site_records(sites, ledger, results)
    if missing:
        log.warning("%s", missing)
    ledger.to_csv(results / "ledger.csv", index=False)
    rounds.to_csv(metrics / "rounds.csv", index=False)
    sites.to_csv(metrics / "sites.csv", index=False)
    plot_perplexity(rounds, initial, results / "plots" / "perplexity.png")
    plot_round_time(rounds, results / "plots" / "round_time.png")
    plot_perplexity_wallclock(rounds, initial, results / "plots" / "perplexity_wallclock.png")
    plot_probe_history(probe_history(results), results / "plots" / "probes.png")
    run_goodput = goodput(site_jobs(results))
    plot_goodput(rounds, run_goodput, results / "plots" / "goodput.png")
    plans, chains = plan_table(results), chain_table(results)
    plans.to_csv(metrics / "plans.csv", index=False)
    chains.to_csv(metrics / "chains.csv", index=False)
    pages = results / "report"
    table_html(ledger, "DARL ledger (Table 3)", "ledger.csv", pages / "ledger.html")
    table_html(
        rounds, "Rounds (Table 1 decomposition)", "metrics/rounds.csv", pages / "rounds.html"
    )
    table_html(
        sites, "Site jobs, one row per round and site", "metrics/sites.csv", pages / "sites.html"
    )
    table_html(plans, "Placement plans", "metrics/plans.csv", pages / "plans.html")
    table_html(chains, "Chained Slurm jobs", "metrics/chains.csv", pages / "chains.html")
    last = rounds.iloc[-1]
    summary = {
        "val_perplexity": float(last["val_perplexity"]),
        "val_loss": float(last["val_loss"]),
        "initial_val_perplexity": float(initial["val_perplexity"]),
        "rounds": int(len(rounds)),
        "tokens": int(rounds["tokens"].sum()),
        "global_step": int(last["global_step"]),
        "sites": site_names,
        "contributions": contributions(results, site_names),
        # connected: without the time the workflow was stopped between invocations
        "wall_s": float(
            rounds["closed_at"].max() - rounds["opened_at"].min() - rounds["idle_s"].sum()
        ),
        "stopped_s": float(rounds["idle_s"].sum()),
        "compute_s": float(rounds["compute_s"].sum()),
        "overhead_s": float(rounds["overhead_s"].sum()),
        "goodput": run_goodput,
        "blocks_committed": int(ledger[ledger["site"] == "total"]["blocks_committed"].iloc[0]),
        "blocks_lost": int(ledger[ledger["site"] == "total"]["blocks_lost"].iloc[0]),
    }
    write_atomic(metrics / "final.json", json.dumps(summary, indent=2) + "\n")
    return summary
