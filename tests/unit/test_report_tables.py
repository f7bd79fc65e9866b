"""The report's tables: a run whose rounds all closed before their plans still has a plans table;
a run without its site records says so."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from crossfed.report import PLAN_COLUMNS, missing_site_records, plan_table, site_table


def write_plan(results: Path, round_no: int, sites: dict) -> None:
    folder = results / "rounds" / str(round_no)
    folder.mkdir(parents=True)
    detail = f"round {round_no} closed; coordinator is at round {round_no + 1}: not planned"
    plan = {"mode": "closed" if not sites else "barrier", "sites": sites, "detail": detail}
    (folder / "plan.json").write_text(json.dumps(plan))


def test_rounds_that_closed_before_their_plans_leave_a_table_with_its_header(
    tmp_path: Path,
) -> None:
    for r in (1, 2):
        write_plan(tmp_path, r, {})
    table = plan_table(tmp_path)
    assert table.empty and list(table.columns) == PLAN_COLUMNS
    table.to_csv(tmp_path / "plans.csv", index=False)
    read = pd.read_csv(tmp_path / "plans.csv")  # the report page and its tests read it back
    assert read.empty and list(read.columns) == PLAN_COLUMNS


def test_a_planned_round_gives_one_row_per_site(tmp_path: Path) -> None:
    write_plan(tmp_path, 1, {})
    write_plan(tmp_path, 2, {"lumi": {"submit": True, "accumulation": 2, "reason": "fill"}})
    table = plan_table(tmp_path)
    assert table[["plan", "site", "submit", "accumulation"]].values.tolist() == [
        ["round 2", "lumi", True, 2]
    ]
    assert list(table.columns) == ["plan", "site", "submit", "accumulation", "reason"]


def test_a_results_folder_without_site_records_is_named_when_blocks_were_committed(
    tmp_path: Path,
) -> None:
    """The site table of a folder with no round records is empty: the report says so when
    the ledger counts committed blocks (the records are missing), not when it counts none
    (nothing trained yet), nor once a record is there."""
    ledger = pd.DataFrame(
        [{"site": "lumi", "blocks_committed": 12}, {"site": "total", "blocks_committed": 12}]
    )
    sites = site_table(tmp_path)
    said = missing_site_records(sites, ledger, tmp_path)
    assert sites.empty and said is not None
    assert "12 committed blocks" in said and str(tmp_path / "rounds") in said
    nothing = ledger.assign(blocks_committed=0)
    assert missing_site_records(sites, nothing, tmp_path) is None
    record = tmp_path / "rounds" / "1" / "train" / "lumi.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"round": 1, "site": "lumi", "status": "accepted"}))
    assert missing_site_records(site_table(tmp_path), ledger, tmp_path) is None
