"""`crossfed status` on a live run and on a stopped one: round k of N, perplexity, ETA, leases.

A real coordinator process serves a tiny run; the workflow's own commands (`round wait`,
`checkpoint`) write the round record and the evaluations `status` reads. Then the
coordinator is killed and `status` reads its state directory instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from crossfed.cli import main
from crossfed.coordinator.service import read_ledger, read_status
from tests.conftest import REPO, LiveCoordinator
from tests.unit.test_security import cli_config
from tests.unit.test_status_page import merge_round_one_and_lease_round_two


@pytest.fixture
def round_one(run: LiveCoordinator, tiny_data: Path, tmp_path: Path) -> Path:
    """Round 1 merged from two sites and evaluated by the CLI; frontier holds a round-2
    lease. Returns a run directory whose config/config.yaml names the live coordinator."""
    path = cli_config(run, tiny_data, tmp_path)
    config = yaml.safe_load(path.read_text())
    config.update(rounds=3, results="results")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    merge_round_one_and_lease_round_two(run, tiny_data, tmp_path)
    return tmp_path


def crossfed(*argv: str) -> None:
    assert main(list(argv)) == 0


def workflow_outputs(cwd: Path) -> None:
    """What the merge and checkpoint rules write for rounds 0 and 1, by their commands."""
    rounds = cwd / "results" / "rounds"
    crossfed("round", "wait", "--round", "1", "--out", str(rounds / "1" / "merge.json"))
    for generation in (0, 1):
        model = cwd / "results" / "checkpoints" / f"global-{generation}.safetensors"
        out = rounds / str(generation) / "eval.json"
        crossfed(
            "checkpoint",
            "--generation",
            str(generation),
            "--model-out",
            str(model),
            "--out",
            str(out),
        )


def test_status_of_a_live_run_shows_round_k_of_n_perplexity_eta_and_leases(
    round_one: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(round_one)
    workflow_outputs(round_one)
    evals = {
        r: json.loads((round_one / f"results/rounds/{r}/eval.json").read_text()) for r in (0, 1)
    }
    capsys.readouterr()
    crossfed("status")
    out = capsys.readouterr().out
    assert "(coordinator live)" in out
    assert "round 2 of 3 open (1 closed)" in out
    ppl1, ppl0 = evals[1]["val_perplexity"], evals[0]["val_perplexity"]
    assert f"last held-out perplexity {ppl1:.2f} (round 1; {ppl0:.2f} at round 0)" in out
    assert re.search(r"^ETA \S+ \(rounds take about \S+\)$", out, re.M), out
    assert re.search(r"lease +\d+ frontier +round 2 1/2 blocks, expires in \d+s", out), out

    crossfed("status", "--json")
    state = json.loads(capsys.readouterr().out)
    assert state["live"] is True and state["round"] == 2
    progress = state["progress"]
    assert progress["rounds"] == 3 and progress["rounds_closed"] == 1
    assert progress["val_perplexity"] == pytest.approx(ppl1) and progress["eta_s"] > 0


def test_status_of_a_stopped_run_reads_the_state_directory_and_the_effective_config(
    round_one: Path,
    run: LiveCoordinator,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(round_one)
    workflow_outputs(round_one)
    live_status = run.client().status()
    live_ledger = run.client().ledger()
    run.kill()
    # the workflow's view: an embedded coordinator (now stopped) over this state directory,
    # and an effective config (a --config rounds=5 override) beside the results
    config = yaml.safe_load((round_one / "config" / "config.yaml").read_text())
    config["coordinator"].update(url="embedded", state_dir=str(run.state_dir))
    (round_one / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    effective = round_one / "results" / ".crossfed" / "config.yaml"
    effective.parent.mkdir(parents=True)
    effective.write_text(yaml.safe_dump({**config, "rounds": 5}))

    stopped = read_status(run.state_dir)
    for key in ("round", "generation", "global_step", "epoch", "blocks_committed_in_epoch"):
        assert stopped[key] == live_status[key], key
    assert [lease["site"] for lease in stopped["active_leases"]] == ["frontier"]
    assert read_ledger(run.state_dir) == live_ledger

    capsys.readouterr()
    crossfed("status")
    out = capsys.readouterr().out
    assert f"(coordinator stopped; read from {run.state_dir})" in out
    assert "round 2 of 5 open when the run stopped (1 closed)" in out  # the effective config
    assert "last held-out perplexity" in out and "of training once resumed" in out
    assert re.search(r"lease +\d+ frontier +round 2 1/2 blocks", out), out

    # --config at its default path still means the effective config; another file is
    # read as given
    crossfed("status", "--config", "config/config.yaml", "--json")
    state = json.loads(capsys.readouterr().out)
    assert state["live"] is False and state["progress"]["rounds"] == 5
    other = round_one / "other.yaml"
    other.write_text(yaml.safe_dump({**config, "rounds": 4}))
    crossfed("status", "--config", str(other), "--json")
    assert json.loads(capsys.readouterr().out)["progress"]["rounds"] == 4


def test_status_without_any_state_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["sites_file"] = str(REPO / "config" / "sites.yaml")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert "embedded coordinator not running" in err and "endpoint.json missing" in err


def test_a_rule_command_under_log_shows_progress_and_keeps_the_rest_in_its_log(
    round_one: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The merge rule's `round wait`: the terminal gets its run-level progress line (round
    k of N, ETA), the rule log that line and the details too."""
    monkeypatch.chdir(round_one)
    log = round_one / "results" / "logs" / "merge" / "1.log"
    out = round_one / "results" / "rounds" / "1" / "merge.json"
    capsys.readouterr()
    crossfed("--log", str(log), "round", "wait", "--round", "1", "--out", str(out))
    terminal = capsys.readouterr().err
    text = log.read_text()
    line = re.search(
        r"^\d\d:\d\d:\d\d (round 1/3 closed \(\w+\): \S+, loss .*; ETA .*)$", terminal, re.M
    )
    assert line, terminal
    assert line.group(1) in text
    assert "INFO crossfed.round: round 1 closed" in text  # details: the log only
    assert "crossfed.round" not in terminal and "INFO" not in terminal
