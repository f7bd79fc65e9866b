"""The run as its user sees it: the terminal of a workflow run, `status` and `report` once it
has stopped, and the `--report` page in headless Chromium.

One real two-round run of the local profile (three sites, a real coordinator), then the
report's pages are taken out of Snakemake's HTML and rendered as Chromium renders them.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from crossfed.report import ROUND_PARTS, no_probes_reason, probe_history, round_phases
from tests.helpers.workflow import crossfed_cli, finish, snakemake, workdir
from tests.unit.test_status_page import ARTIFACTS, chromium

pytestmark = pytest.mark.slow
TABLES = {
    "ledger.html": "ledger.csv",
    "rounds.html": "metrics/rounds.csv",
    "sites.html": "metrics/sites.csv",
    "plans.html": "metrics/plans.csv",
    "chains.html": "metrics/chains.csv",
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished two-round run and what its terminal showed."""
    cwd = workdir(tmp_path_factory.mktemp("report-run"), rounds=2)
    return cwd, finish(snakemake(cwd))


def crossfed(cwd: Path, *argv: str) -> str:
    """What `crossfed` printed (it must succeed), both streams, as a terminal shows them."""
    done = crossfed_cli(cwd, *argv)
    return done.stdout + done.stderr


def test_the_terminal_shows_training_progress_not_job_banners(finished: tuple[Path, str]) -> None:
    cwd, out = finished
    steps = re.findall(
        r"^\d\d:\d\d:\d\d (\w+) +round ([12])/2 +step +\d+/\d+ +loss \d+\.\d{4} +[\d,]+ tok/s"
        r" +MFU n/a$",
        out,
        re.M,
    )
    # every site that trained a round shows its steps (a slow machine may make one miss both)
    trained = {
        json.loads(p.read_text())["site"]
        for p in (cwd / "results" / "rounds").glob("*/train/*.json")
        if json.loads(p.read_text())["status"] == "accepted"
    }
    assert trained and {site for site, _ in steps} == trained, out[-3000:]
    assert {round_no for _, round_no in steps} == {"1", "2"}
    assert re.search(r"round 1/2 closed \(\w+\): .*; ETA \S+ \(about \d\d:\d\d\)", out), out
    assert re.search(r"round 2/2 closed .*; last round closed", out)
    assert re.search(r"round 2/2 global model: held-out loss \d+\.\d{4}, perplexity", out)
    assert "final held-out perplexity" in out
    # Snakemake's job banners and job counts, torchtitan's parameter counts: in the logs
    for noise in (
        "rule train:",
        "localrule merge:",
        "reason: Missing output",
        "steps (",
        "Total parameter count",
        "INFO crossfed.site",
    ):
        assert noise not in out, noise
    (log,) = (cwd / "results" / "logs" / "train").glob("lumi-*.log")  # the site loop's job
    log = log.read_text()
    assert "INFO crossfed.site: [lumi r2] step" in log  # the details


def test_status_and_report_of_the_stopped_run(finished: tuple[Path, str]) -> None:
    cwd, _ = finished
    assert not (cwd / "results" / "coordinator" / "endpoint.json").exists()  # stopped
    out = crossfed(cwd, "status")
    final = json.loads((cwd / "results" / "metrics" / "final.json").read_text())
    assert "coordinator stopped; read from results/coordinator" in out
    assert "finished: 2 of 2 rounds closed" in out
    assert f"last held-out perplexity {final['val_perplexity']:.2f} (round 2;" in out
    before = (cwd / "results" / "ledger.csv").read_text()
    (cwd / "results" / "ledger.csv").unlink()
    out = crossfed(cwd, "report")
    assert f"final held-out perplexity {final['val_perplexity']:.2f} after 2 rounds" in out
    assert (cwd / "results" / "ledger.csv").read_text() == before  # from the state directory


def embedded(report: str) -> dict[str, tuple[str, bytes]]:
    """The files Snakemake's report carries as data URIs: name -> (mime type, bytes)."""
    found = {}
    for mime, name, data in re.findall(
        r"data:([\w/+-]+);charset=utf8;filename=([^;]+);base64,([A-Za-z0-9+/=]+)", report
    ):
        found[name] = (mime, base64.b64decode(data))
    return found


def test_the_report_page_shows_tables_and_named_figures_in_chromium(
    finished: tuple[Path, str], tmp_path: Path
) -> None:
    cwd, _ = finished
    results = cwd / "results"
    finish(snakemake(cwd, "--report", "report.html", name="report"))
    html = (cwd / "report.html").read_text()
    files = embedded(html)
    assert set(TABLES) <= set(files), sorted(files)
    assert not [n for n, (mime, _) in files.items() if mime == "text/csv"]  # no downloads
    pages = tmp_path / "pages"
    pages.mkdir()
    for name, csv in TABLES.items():
        mime, body = files[name]
        assert mime == "text/html"
        (pages / name).write_bytes(body)
        dom = chromium(tmp_path, "--dump-dom", (pages / name).as_uri()).stdout
        frame = pd.read_csv(results / csv)
        header = re.findall(r"<th>([^<]*)</th>", dom)
        assert header == list(frame.columns), name
        assert dom.count("<tr") - 1 == len(frame), name  # less the header row
        assert ("(no rows)" in dom) == frame.empty, name
    rounds = pd.read_csv(results / "metrics" / "rounds.csv")
    parts = [column for column, _, _ in ROUND_PARTS]
    assert set(parts) <= set(rounds.columns)
    assert (rounds[parts].sum(axis=1) - rounds["round_s"]).abs().max() < 1e-6  # all of it
    final = json.loads((results / "metrics" / "final.json").read_text())
    assert 0 < final["goodput"] < 1  # the sites' accepted compute over their jobs' seconds
    assert rounds["goodput"].between(0, 1).all()
    for name in ("perplexity.png", "perplexity_wallclock.png", "round_time.png", "probes.png",
                 "goodput.png"):  # fmt: skip
        assert files[name][0] == "image/png", name
        picture = matplotlib.image.imread(results / "plots" / name)
        drawn = (picture[..., :3] < 0.9).any(axis=-1).mean()  # share of non-white pixels
        assert drawn > 0.002, name
    # no site has a scheduler here: the probe figure says so instead of empty axes
    assert "no site of this run has a batch" in no_probes_reason(probe_history(results))

    # the page itself: Snakemake's report app renders its categories
    dom = chromium(
        tmp_path, "--virtual-time-budget=8000", "--dump-dom", (cwd / "report.html").as_uri()
    ).stdout
    for category in ("Data leasing", "Overhead", "Placement", "Training"):
        assert category in dom, category
    shots = {"report.png": cwd / "report.html", "report-rounds.png": pages / "rounds.html"}
    for shot_name, page in shots.items():
        shot = tmp_path / shot_name
        done = chromium(
            tmp_path,
            f"--screenshot={shot}",
            "--window-size=1400,900",
            "--virtual-time-budget=8000",
            "--hide-scrollbars",
            page.as_uri(),
        )
        assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
        try:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, ARTIFACTS / shot_name)
        except OSError:
            pass  # a read-only checkout keeps the screenshot in the pytest tmp dir only


def write_round(
    results: Path, round_no: int, opened: float, probed: float, lease: float, closed: float
) -> None:
    """A round's merge record and probe file as the merge and probe rules write them."""
    folder = results / "rounds" / str(round_no)
    folder.mkdir(parents=True)
    info = {"round_no": round_no, "opened_at": opened, "first_lease_at": lease, "closed_at": closed}
    (folder / "merge.json").write_text(json.dumps(info))
    stamp = pd.Timestamp(probed, unit="s", tz="UTC").isoformat()
    (folder / "probe.csv").write_text(f"probed_at,site\n{stamp},lumi\n")


def two_rounds(opened: float, between: float, closed: float, compute_s: list[float]):
    """rounds.csv's columns for two rounds back to back, 1 s of comms, 0.5 s of checkpoints
    and 0.1 s of merge each."""
    return pd.DataFrame(
        {
            "round": [1, 2],
            "opened_at": [opened, between],
            "closed_at": [between, closed],
            "round_s": [between - opened, closed - between],
            "compute_s": compute_s,
            "comms_s": [1.0, 1.0],
            "checkpoint_s": [0.5, 0.5],
            "merge_s": [0.1, 0.1],
        }
    )


def test_round_parts_name_all_of_round_s_and_leave_out_a_stopped_workflow(tmp_path: Path) -> None:
    """Round 2 opened when round 1 closed, but the workflow was stopped for 10 minutes
    before it probed again (an extended run): that gap is idle, not the run's wall-clock."""
    t = 1_800_000_000.0
    write_round(tmp_path, 1, t, t + 2, t + 20, t + 60)
    write_round(tmp_path, 2, t + 60, t + 660, t + 680, t + 720)
    frame = round_phases(two_rounds(t, t + 60, t + 720, compute_s=[20.0, 20.0]), tmp_path)
    assert frame["until_probe_s"].tolist() == pytest.approx([2.0, 600.0])
    assert frame["startup_s"].tolist() == pytest.approx([18.0, 20.0])
    parts = frame[[column for column, _, _ in ROUND_PARTS]].sum(axis=1)
    assert parts.tolist() == pytest.approx([60.0, 660.0])
    assert frame["other_s"].tolist() == pytest.approx([18.4, 18.4])
    assert frame["idle_s"].tolist() == pytest.approx([0.0, 600.0])  # 2 s: the merge job
    assert frame["compute_in_round_s"].tolist() == pytest.approx([20.0, 20.0])  # all inside


def test_an_overlapped_phase_that_began_before_its_round_opened_is_cut_to_the_round(
    tmp_path: Path,
) -> None:
    """Round 2 lasts 10 s, but its slowest site's phase took 12 s of compute: it began in
    round 1's period. The parts keep to round 2's 10 s; compute gets what is left of it."""
    t = 1_800_000_000.0
    write_round(tmp_path, 1, t, t + 1, t + 2, t + 30)
    write_round(tmp_path, 2, t + 30, t + 30, t + 30, t + 40)
    frame = round_phases(two_rounds(t, t + 30, t + 40, compute_s=[20.0, 12.0]), tmp_path)
    parts = frame[[column for column, _, _ in ROUND_PARTS]]
    assert (parts >= 0).all().all()
    assert parts.sum(axis=1).tolist() == pytest.approx([30.0, 10.0])
    assert frame["compute_in_round_s"].tolist() == pytest.approx([20.0, 10.0])
    assert frame["comms_in_round_s"].tolist() == pytest.approx([1.0, 0.0])
    assert frame["other_s"].tolist() == pytest.approx([30.0 - 1 - 1 - 20 - 1.6, 0.0])
    assert frame["compute_s"].tolist() == [20.0, 12.0]  # the measured seconds stay as they were
