"""The progress lines and figures users follow a run by (crossfed.progress)."""

from __future__ import annotations

import pytest

from crossfed.progress import (
    duration,
    eta_s,
    ledger_line,
    progress_lines,
    round_line,
    run_progress,
    step_line,
)


def test_duration_reads_like_a_clock() -> None:
    assert [duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    assert duration(None) == duration(float("nan")) == "?"


def test_the_eta_is_the_median_round_times_the_rounds_left() -> None:
    # round 3 took 700 s because the workflow was stopped inside it: the median ignores it
    seconds = [30.0, 32.0, 700.0, 31.0]
    assert eta_s(seconds, rounds_total=8, open_round=5) == pytest.approx(31.5 * 4)
    # the open round has been running for 10 s already
    assert eta_s(seconds, 8, 5, open_for_s=10.0) == pytest.approx(21.5 + 31.5 * 3)
    assert eta_s([], 8, 1) is None  # nothing closed yet: no estimate
    assert eta_s(seconds, 4, 5) == 0.0  # every round closed


def test_a_step_line_has_round_k_of_n_step_loss_to_4_digits_tokens_per_s_and_mfu() -> None:
    line = step_line("lumi", 2, 8, 10, 25, 5.123456, 12345.6, None)
    assert line.split() == [
        "lumi",
        "round",
        "2/8",
        "step",
        "10/25",
        "loss",
        "5.1235",
        "12,346",
        "tok/s",
        "MFU",
        "n/a",
    ]
    assert step_line("lumi", 2, 8, 10, 25, 5.1, 1.0, 0.4125).endswith("MFU 41.2%")


def test_a_round_line_names_the_round_its_sites_and_the_runs_eta() -> None:
    info = {
        "round_no": 2,
        "report": {
            "reason": "all_in",
            "contributors": ["lumi", "snellius"],
            "tokens": 12032,
            "loss": 5.36549,
        },
    }
    line = round_line(info, 8, [60.0, 30.0], now=0.0)
    assert line.startswith("round 2/8 closed (all_in): lumi+snellius, loss 5.3655, 12,032 tokens")
    assert "30s; ETA 4m30s" in line  # 6 rounds left at the 45 s median
    assert round_line({**info, "round_no": 8}, 8, [30.0], 0.0).endswith("last round closed")


def test_run_progress_open_finished_and_stopped() -> None:
    evals = {
        0: {"val_perplexity": 4110.0},
        1: {"val_perplexity": 900.0},
        2: {"val_perplexity": 517.5},
    }
    live = run_progress({"round": 3}, 8, [40.0, 40.0], evals, open_since=100.0, now=110.0)
    assert live["rounds_closed"] == 2 and not live["finished"]
    assert live["eta_s"] == pytest.approx(30.0 + 40.0 * 5)
    assert live["val_perplexity"] == 517.5 and live["last_eval_round"] == 2
    lines = progress_lines(live, live=True)
    assert lines[0] == "round 3 of 8 open (2 closed)"
    assert lines[1] == "last held-out perplexity 517.50 (round 2; 4110.00 at round 0)"
    assert lines[2] == "ETA 3m50s (rounds take about 40s)"
    stopped = run_progress({"round": 3}, 8, [40.0, 40.0], evals, open_since=None, now=9e9)
    assert stopped["eta_s"] == pytest.approx(40.0 * 6)  # no time counted while stopped
    assert (
        progress_lines(stopped, live=False)[0]
        == "round 3 of 8 open when the run stopped (2 closed)"
    )
    done = run_progress({"round": 9}, 8, [40.0] * 8, evals, open_since=None, now=0.0)
    assert done["finished"] and done["rounds_closed"] == 8
    assert progress_lines(done, live=False)[0] == "finished: 8 of 8 rounds closed"


def test_the_ledger_line_says_epochs_count_from_0_and_how_many_came_before() -> None:
    status = {"generation": 3, "global_step": 96, "epoch": 0, "blocks_committed_in_epoch": 412,
              "blocks_total": 883}  # fmt: skip
    assert ledger_line(status) == (
        "generation 3  global step 96  epoch 0 (counted from 0): 412/883 blocks committed"
    )
    # a run that trained its whole first epoch (the Quick start's) is in epoch 1, none of
    # its blocks committed yet
    finished = {**status, "generation": 8, "global_step": 256, "epoch": 1,
                "blocks_committed_in_epoch": 0}  # fmt: skip
    assert ledger_line(finished).endswith(
        "epoch 1 (counted from 0): 0/883 blocks committed; 1 full epoch before it"
    )
    assert ledger_line({**finished, "epoch": 3}).endswith("; 3 full epochs before it")
