"""The run's results: final metrics, per-round and per-site tables, the ledger and plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from crossfed.darl.ledger import TABLE3_COLUMNS  # noqa: E402
from crossfed.train.barrier import idle_shares  # noqa: E402


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
        "blocks_leased",
        "blocks_committed",
        "transport",
        "rtt_ms",
        "detail",
    ]
    frame = idle_shares(frame)  # time each site waited at the round barrier (paper Fig. 2a)
    return frame[[c for c in keep if c in frame]].sort_values(["round", "site"])


def round_table(results: Path, sites: pd.DataFrame) -> pd.DataFrame:
    """One row per closed round: who contributed, loss, held-out perplexity and time split."""
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
    return frame


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


def plot_round_time(rounds: pd.DataFrame, path: Path) -> Path:
    """Per-round compute vs overhead seconds (paper Fig. 2b / Table 1)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(rounds["round"], rounds["compute_s"], label="compute (slowest site)")
    ax.bar(
        rounds["round"],
        rounds["overhead_s"],
        bottom=rounds["compute_s"],
        label="overhead (comms + merge + checkpoint + eval)",
    )
    ax.set_xlabel("outer round")
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_perplexity_wallclock(rounds: pd.DataFrame, initial: dict[str, Any], path: Path) -> Path:
    """Held-out perplexity against connected wall-clock time (paper Fig. 1b)."""
    start = float(rounds["opened_at"].min()) if len(rounds) else 0.0
    hours = [0.0] + ((rounds["closed_at"] - start) / 3600.0).tolist()
    ppl = [initial["val_perplexity"]] + rounds["val_perplexity"].tolist()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hours, ppl, marker="o", label="global model (held-out)")
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock hours since round 1 opened")
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
    frame = pd.DataFrame(rows)
    return frame[[c for c in PLAN_COLUMNS if c in frame]] if len(frame) else frame


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
            ax.plot(rows["probed_at"], rows["wait_s"] / 60.0, marker=".", label=f"{site} {shape}")
            shown = True
    if shown:
        ax.set_xlabel("probed at (UTC)")
        ax.set_ylabel("predicted wait (minutes)")
        ax.legend(fontsize="small")
        fig.autofmt_xdate()
    else:
        ax.text(0.5, 0.5, "no successful scheduler probes", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title("queue probes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(config: dict[str, Any], site_names: list[str], results: Path) -> dict[str, Any]:
    """Write metrics/final.json, metrics/rounds.csv, metrics/sites.csv, ledger.csv and plots."""
    from crossfed.coordinator.embedded import client_for

    metrics = results / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    sites = site_table(results)
    rounds = round_table(results, sites)
    initial = _read(results / "rounds" / "0" / "eval.json")
    ledger = pd.DataFrame(client_for(config, "admin").ledger())[list(TABLE3_COLUMNS)]
    check_ledger(ledger)
    ledger.to_csv(results / "ledger.csv", index=False)
    rounds.to_csv(metrics / "rounds.csv", index=False)
    sites.to_csv(metrics / "sites.csv", index=False)
    plot_perplexity(rounds, initial, results / "plots" / "perplexity.png")
    plot_round_time(rounds, results / "plots" / "round_time.png")
    plot_perplexity_wallclock(rounds, initial, results / "plots" / "perplexity_wallclock.png")
    plot_probe_history(probe_history(results), results / "plots" / "probes.png")
    plan_table(results).to_csv(metrics / "plans.csv", index=False)
    chain_table(results).to_csv(metrics / "chains.csv", index=False)
    last = rounds.iloc[-1]
    summary = {
        "val_perplexity": float(last["val_perplexity"]),
        "val_loss": float(last["val_loss"]),
        "initial_val_perplexity": float(initial["val_perplexity"]),
        "rounds": int(len(rounds)),
        "tokens": int(rounds["tokens"].sum()),
        "global_step": int(last["global_step"]),
        "sites": site_names,
        "contributions": {
            s: int((sites["site"] == s).where(sites["status"] == "accepted", False).sum())
            for s in site_names
        },
        "wall_s": float(rounds["closed_at"].max() - rounds["opened_at"].min()),
        "compute_s": float(rounds["compute_s"].sum()),
        "overhead_s": float(rounds["overhead_s"].sum()),
        "blocks_committed": int(ledger[ledger["site"] == "total"]["blocks_committed"].iloc[0]),
        "blocks_lost": int(ledger[ledger["site"] == "total"]["blocks_lost"].iloc[0]),
    }
    tmp = metrics / "final.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, metrics / "final.json")
    return summary
