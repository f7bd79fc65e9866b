"""Run progress as people follow it: round k of N, loss, tokens/s, MFU, perplexity and an ETA.

Pure functions over figures the jobs already have, plus ``CONSOLE``: the logger whose lines
reach the terminal when a command logs to a rule log (``crossfed --log``); everything else a
rule's command says goes to its log only.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

#: Lines for the person watching the run (terminal and rule log alike).
CONSOLE = logging.getLogger("crossfed.console")
#: Closed rounds the ETA's typical round length is taken over (the median: a round that
#: includes a stop between two workflow invocations does not skew it).
ETA_WINDOW = 5


def duration(seconds: float | None) -> str:
    """``seconds`` as people read them: 42s, 3m05s, 2h07m; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def typical_round_s(round_seconds: list[float]) -> float | None:
    """Median length of the last ``ETA_WINDOW`` closed rounds (None before any closed)."""
    recent = [s for s in round_seconds if s > 0][-ETA_WINDOW:]
    return statistics.median(recent) if recent else None


def eta_s(
    round_seconds: list[float], rounds_total: int, open_round: int, open_for_s: float = 0.0
) -> float | None:
    """Seconds until round ``rounds_total`` closes, with round ``open_round`` open for
    ``open_for_s``; 0 once every round has closed, None before a round has closed."""
    if open_round > rounds_total:
        return 0.0
    typical = typical_round_s(round_seconds)
    if typical is None:
        return None
    left = rounds_total - open_round
    return max(0.0, typical - open_for_s) + typical * left


def mfu_text(mfu: float | None) -> str:
    """MFU as a percentage, or ``n/a`` where it is not known (CPU sites)."""
    return "n/a" if mfu is None else f"{100.0 * mfu:.1f}%"


def step_line(
    site: str,
    round_no: int,
    rounds_total: int | None,
    step: int,
    steps: int,
    loss: float,
    tokens_per_s: float,
    mfu: float | None,
) -> str:
    """One line per logging interval, as torchtitan prints them."""
    of = f"/{rounds_total}" if rounds_total else ""
    return (
        f"{site:<10} round {round_no}{of}  step {step:>3}/{steps}  loss {loss:.4f}  "
        f"{tokens_per_s:,.0f} tok/s  MFU {mfu_text(mfu)}"
    )


def round_line(
    info: dict[str, Any], rounds_total: int, round_seconds: list[float], now: float
) -> str:
    """The run-level line when a round closes: round k of N, who, loss, tokens and an ETA.

    ``info`` is the coordinator's round record (``round_no``, ``report``, times);
    ``round_seconds`` the lengths of every closed round so far, this one included.
    """
    report = info["report"]
    k = info["round_no"]
    loss = report.get("loss")
    eta = eta_s(round_seconds, rounds_total, k + 1, 0.0)
    if k >= rounds_total:
        tail = "last round closed"
    else:
        tail = f"ETA {duration(eta)} (about {time.strftime('%H:%M', time.localtime(now + eta))})"
        tail = tail if eta is not None else "ETA ?"
    return (
        f"round {k}/{rounds_total} closed ({report['reason']}): "
        f"{'+'.join(report['contributors'])}, loss "
        f"{'n/a' if loss is None else f'{loss:.4f}'}, {report['tokens']:,} tokens, "
        f"{duration(round_seconds[-1] if round_seconds else None)}; {tail}"
    )


def closed_round_seconds(results: Path, before: int | None = None) -> list[float]:
    """Lengths (open to close) of the rounds the workflow has seen close (those before
    round ``before`` if given), in round order."""
    rows = []
    for path in results.glob("rounds/*/merge.json"):
        info = json.loads(path.read_text())
        if before is not None and info["round_no"] >= before:
            continue
        if info.get("closed_at"):
            rows.append((info["round_no"], info["closed_at"] - info["opened_at"]))
    return [s for _, s in sorted(rows)]


def evaluations(results: Path) -> dict[int, dict[str, Any]]:
    """Held-out evaluations the workflow has written, by round (0: the initial model)."""
    found = {}
    for path in results.glob("rounds/*/eval.json"):
        if path.parent.name.isdigit():
            found[int(path.parent.name)] = json.loads(path.read_text())
    return dict(sorted(found.items()))


def run_progress(
    status: dict[str, Any],
    rounds_total: int,
    round_seconds: list[float],
    evals: dict[int, dict[str, Any]],
    open_since: float | None,
    now: float,
) -> dict[str, Any]:
    """The figures ``crossfed status`` shows: round k of N, closed rounds, perplexity, ETA.

    ``open_since`` is when the open round opened (its predecessor's close), if known.
    """
    open_round = int(status["round"])
    closed = min(open_round - 1, rounds_total)
    finished = open_round > rounds_total
    open_for = max(0.0, now - open_since) if open_since is not None and not finished else 0.0
    last = max((r for r in evals if r > 0), default=None)
    return {
        "round": open_round,
        "rounds": rounds_total,
        "rounds_closed": closed,
        "finished": finished,
        "round_s_typical": typical_round_s(round_seconds),
        "eta_s": eta_s(round_seconds, rounds_total, open_round, open_for),
        "last_eval_round": last,
        "val_perplexity": evals[last]["val_perplexity"] if last is not None else None,
        "initial_val_perplexity": evals.get(0, {}).get("val_perplexity"),
    }


def progress_lines(progress: dict[str, Any], live: bool) -> list[str]:
    """``run_progress`` figures as the lines ``crossfed status`` prints first."""
    k, n = progress["round"], progress["rounds"]
    if progress["finished"]:
        head = f"finished: {n} of {n} rounds closed"
    else:
        head = f"round {k} of {n} {'open' if live else 'open when the run stopped'}"
        head += f" ({progress['rounds_closed']} closed)"
    lines = [head]
    if progress["val_perplexity"] is not None:
        start = progress["initial_val_perplexity"]
        lines.append(
            f"last held-out perplexity {progress['val_perplexity']:.2f} "
            f"(round {progress['last_eval_round']}"
            + (f"; {start:.2f} at round 0)" if start is not None else ")")
        )
    if not progress["finished"]:
        typical = duration(progress["round_s_typical"])
        if live:
            lines.append(f"ETA {duration(progress['eta_s'])} (rounds take about {typical})")
        else:
            lines.append(
                f"ETA {duration(progress['eta_s'])} of training once resumed "
                f"(rounds take about {typical})"
            )
    return lines


def ledger_line(status: dict[str, Any]) -> str:
    """Where the model and the data stand, as ``crossfed status`` prints it. Epochs count
    from 0, so a run that trained its whole first epoch is in epoch 1 with none of its blocks
    committed yet; the line says how many full epochs came before."""
    epoch = status["epoch"]
    line = (
        f"generation {status['generation']}  global step {status['global_step']}  epoch "
        f"{epoch} (counted from 0): {status['blocks_committed_in_epoch']}/"
        f"{status['blocks_total']} blocks committed"
    )
    if epoch:
        line += f"; {epoch} full epoch{'s' if epoch > 1 else ''} before it"
    return line


def site_prefix(site: str, round_no: int | None = None) -> str:
    """The one prefix of a site's log lines: ``[lumi r3]``, or ``[lumi]`` outside a round."""
    return f"[{site}]" if round_no is None else f"[{site} r{round_no}]"
