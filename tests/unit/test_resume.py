"""Extending a run: what a rerun may change, checked before Snakemake plans anything."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from crossfed import moments
from crossfed.config import ConfigError, load_run_config, load_sites
from crossfed.coordinator.runspec import RunSpec, RunSpecError, differences, run_spec
from crossfed.coordinator.service import Coordinator, CoordinatorError
from crossfed.coordinator.store import round_pause_s
from crossfed.outer_presets import DEFAULT_PRESET, OuterConfig
from crossfed.resume import check_rerun, data_changes
from crossfed.sched import cli as sched_cli
from crossfed.sched.commands import build_parser as sched_parser
from crossfed.site.loop import chain_continues
from crossfed.train.schedule import DEFAULT_MIN_LR_FACTOR, LRSchedule, default_warmup_steps
from tests.conftest import LiveCoordinator, digest_of, staged_delta, tiny_spec
from tests.unit.test_security import cli_config

REPO = Path(__file__).resolve().parents[2]


def test_differences_name_every_changed_field(tiny_data: Path) -> None:
    spec = tiny_spec(tiny_data)
    assert differences(spec, spec) == {}
    other = replace(spec, block_size=16, schedule=replace(spec.schedule, total_steps=99))
    assert differences(spec, other) == {
        "block_size": (8, 16),
        "schedule.total_steps": (spec.schedule.total_steps, 99),
    }


def test_coordinator_extends_the_schedule_and_refuses_other_changes(
    tmp_path: Path, tiny_data: Path
) -> None:
    spec = tiny_spec(tiny_data, schedule=LRSchedule(total_steps=40))
    coordinator = Coordinator(tmp_path / "state")
    assert coordinator.init_run(spec)["created"]
    assert coordinator.init_run(spec)["extended"] is False

    longer = replace(spec, schedule=replace(spec.schedule, total_steps=60))
    reply = coordinator.init_run(longer)
    assert reply["extended"] and reply["schedule"]["total_steps"] == 60
    assert Coordinator(tmp_path / "state").spec == longer  # stored, survives a restart

    with pytest.raises(CoordinatorError) as shorter:
        coordinator.init_run(spec)
    assert shorter.value.status == 409 and "not shortened" in shorter.value.message
    with pytest.raises(CoordinatorError) as other:
        coordinator.init_run(replace(longer, block_size=4))
    assert other.value.code == "run_exists" and "block_size: 8 -> 4" in other.value.message
    assert Coordinator(tmp_path / "state").spec == longer  # the refusals changed nothing


def test_an_unset_outer_preset_is_average_for_a_new_run_and_the_runs_own_on_a_rerun(
    tmp_path: Path, tiny_data: Path
) -> None:
    unset = tiny_spec(tiny_data, outer=OuterConfig(preset=None))
    fresh = Coordinator(tmp_path / "fresh")
    assert fresh.init_run(unset)["outer"]["preset"] == DEFAULT_PRESET == "average"
    assert Coordinator(tmp_path / "fresh").spec.outer.preset == "average"  # stored resolved
    assert fresh.init_run(unset)["created"] is False  # the same config again: no change

    tuned = tiny_spec(tiny_data, outer=OuterConfig(preset="tuned"))  # the default before
    before = Coordinator(tmp_path / "before")
    before.init_run(tuned)
    reply = before.init_run(unset)  # rerun with today's default config: keeps its own step
    assert not reply["created"] and reply["outer"]["preset"] == "tuned"
    assert Coordinator(tmp_path / "before").spec == tuned

    paper = tiny_spec(tiny_data)  # a run created with Eq. 1's fixed eta and beta
    assert paper.outer.preset == "paper"
    old = Coordinator(tmp_path / "old")
    old.init_run(paper)
    reply = old.init_run(unset)  # today's default config: the run keeps its outer step
    assert not reply["created"] and not reply["extended"]
    assert reply["outer"]["preset"] == "paper"
    with pytest.raises(CoordinatorError) as changed:
        old.init_run(replace(unset, outer=OuterConfig(preset="tuned")))
    assert "outer.preset: 'paper' -> 'tuned'" in changed.value.message
    assert Coordinator(tmp_path / "old").spec == paper


def test_an_unset_second_moment_is_shared_for_a_new_run_and_own_for_a_run_stored_before(
    tmp_path: Path, tiny_data: Path
) -> None:
    unset = tiny_spec(tiny_data, second_moment=None)
    fresh = Coordinator(tmp_path / "fresh")
    assert fresh.init_run(unset)["created"]
    assert Coordinator(tmp_path / "fresh").spec.second_moment == moments.DEFAULT_MODE == "shared"
    assert fresh.init_run(unset)["created"] is False

    stored = tiny_spec(tiny_data).to_dict()
    del stored["second_moment"]  # a run stored before the setting existed kept its own
    assert RunSpec.from_dict(stored).second_moment == "own"
    own = Coordinator(tmp_path / "own")
    own.init_run(RunSpec.from_dict(stored))
    reply = own.init_run(unset)  # today's default config: the run keeps each site's own
    assert not reply["created"] and not reply["extended"]
    assert Coordinator(tmp_path / "own").spec.second_moment == "own"
    with pytest.raises(CoordinatorError) as changed:
        own.init_run(replace(unset, second_moment="shared"))
    assert "second_moment: 'own' -> 'shared'" in changed.value.message

    with pytest.raises(RunSpecError, match="second_moment must be one of own, shared"):
        RunSpec.from_dict({**stored, "second_moment": "averaged"})


def test_an_unset_warmup_is_a_tenth_of_a_new_runs_steps_and_stays_the_runs_own(
    tmp_path: Path, tiny_data: Path
) -> None:
    unset = tiny_spec(tiny_data, schedule=LRSchedule(warmup_steps=None, total_steps=400))
    fresh = Coordinator(tmp_path / "fresh")
    assert fresh.init_run(unset)["schedule"]["warmup_steps"] == 40 == default_warmup_steps(400)
    assert Coordinator(tmp_path / "fresh").spec.schedule.warmup_steps == 40  # stored resolved
    assert fresh.init_run(unset)["created"] is False  # the same config again: no change
    longer = replace(unset, schedule=replace(unset.schedule, total_steps=800))
    reply = fresh.init_run(longer)  # more rounds: the warmup its first length gave it
    assert reply["extended"] and reply["schedule"]["warmup_steps"] == 40
    assert Coordinator(tmp_path / "fresh").spec.schedule.warmup_steps == 40
    assert Coordinator(tmp_path / "fresh").spec.schedule.total_steps == 800

    ten = tiny_spec(tiny_data, schedule=LRSchedule(warmup_steps=10, total_steps=400))
    before = Coordinator(tmp_path / "before")  # a run created with the default before: 10
    before.init_run(ten)
    reply = before.init_run(unset)  # today's default config: the run keeps its own warmup
    assert not reply["created"] and not reply["extended"]
    assert reply["schedule"]["warmup_steps"] == 10
    with pytest.raises(CoordinatorError) as changed:
        before.init_run(replace(ten, schedule=replace(ten.schedule, warmup_steps=20)))
    assert "schedule.warmup_steps: 10 -> 20" in changed.value.message
    assert Coordinator(tmp_path / "before").spec == ten  # the refusal changed nothing

    assert default_warmup_steps(1) == 1 and default_warmup_steps(1000) == 100
    for bad in (-1, "ten", 2.5):
        with pytest.raises(RunSpecError, match="schedule.warmup_steps must be an integer >= 0"):
            RunSpec.from_dict({**ten.to_dict(), "schedule": {"warmup_steps": bad}})


def test_an_unset_floor_is_half_the_peak_for_a_new_run_and_stays_the_runs_own(
    tmp_path: Path, tiny_data: Path
) -> None:
    unset = tiny_spec(tiny_data, schedule=LRSchedule(min_lr_factor=None, total_steps=400))
    fresh = Coordinator(tmp_path / "fresh")
    assert fresh.init_run(unset)["schedule"]["min_lr_factor"] == 0.5 == DEFAULT_MIN_LR_FACTOR
    assert Coordinator(tmp_path / "fresh").spec.schedule.min_lr_factor == 0.5  # stored resolved
    assert fresh.init_run(unset)["created"] is False  # the same config again: no change
    longer = replace(unset, schedule=replace(unset.schedule, total_steps=800))
    assert fresh.init_run(longer)["schedule"]["min_lr_factor"] == 0.5  # more rounds keep it

    tenth = tiny_spec(tiny_data, schedule=LRSchedule(min_lr_factor=0.1, total_steps=400))
    before = Coordinator(tmp_path / "before")  # a run created with the default before: 0.1
    before.init_run(tenth)
    reply = before.init_run(unset)  # today's default config: the run keeps its own floor
    assert not reply["created"] and not reply["extended"]
    assert reply["schedule"]["min_lr_factor"] == 0.1
    assert Coordinator(tmp_path / "before").spec.schedule.lr_at(399) == pytest.approx(
        0.1 * tenth.schedule.peak_lr, rel=1e-3
    )  # the sites train the stored schedule: a tenth of the peak at its end
    with pytest.raises(CoordinatorError) as changed:
        before.init_run(replace(tenth, schedule=replace(tenth.schedule, min_lr_factor=0.5)))
    assert "schedule.min_lr_factor: 0.1 -> 0.5" in changed.value.message
    assert Coordinator(tmp_path / "before").spec == tenth  # the refusal changed nothing

    with pytest.raises(ValueError, match="not decided yet"):
        unset.schedule.lr_at(0)
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(RunSpecError, match="schedule.min_lr_factor must be a number in"):
            RunSpec.from_dict({**tenth.to_dict(), "schedule": {"min_lr_factor": bad}})


@pytest.mark.parametrize(
    ("setting", "before", "other"), [("warmup_steps", 10, 20), ("min_lr_factor", 0.1, 0.3)]
)
def test_a_run_recorded_before_a_schedule_default_reruns_and_extends_unchanged(
    tmp_path: Path, tiny_data: Path, setting: str, before: float, other: float
) -> None:
    overrides = _workdir(tmp_path, tiny_data)
    inner = load_run_config(None, overrides).inner
    assert getattr(inner, setting) is None  # the default config leaves it unset
    run_json = tmp_path / "results" / "run.json"
    record = json.loads(run_json.read_text())
    record["spec"]["schedule"][setting] = before  # what the default config gave before
    run_json.write_text(json.dumps(record))
    _check(overrides)  # the config leaves it unset: the run's own
    _check({**overrides, "rounds": 10})
    with pytest.raises(ConfigError, match=f"schedule.{setting}: {before} -> {other}"):
        _check({**overrides, "inner": {setting: other}})


def test_a_run_recorded_before_outer_presets_reruns_unchanged(
    tmp_path: Path, tiny_data: Path
) -> None:
    overrides = _workdir(tmp_path, tiny_data)
    run_json = tmp_path / "results" / "run.json"
    record = json.loads(run_json.read_text())
    record["spec"]["outer"] = {"eta": 0.7, "beta": 0.9, "solo_full_step": True}  # no preset
    run_json.write_text(json.dumps(record))
    _check(overrides)  # the default config leaves outer.preset unset: the run's own (paper)
    _check({**overrides, "rounds": 10})
    with pytest.raises(ConfigError, match="outer.preset: 'paper' -> 'tuned'"):
        _check({**overrides, "outer": {"preset": "tuned"}})


def test_run_json_records_the_run_as_the_coordinator_decided_it(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """`crossfed run init` records the coordinator's run, every setting the config left
    unset decided, so a config that later spells out the run's own values goes on and one
    that changes them is refused naming the run's value."""
    config = cli_config(coordinator, tiny_data, tmp_path)  # config.yaml's unset defaults
    run_json = tmp_path / "results" / "run.json"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "crossfed"), "run", "init", "--config", str(config),
         "--out", str(run_json)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(run_json.read_text())["spec"]
    assert recorded == coordinator.client().status()["spec"]
    warmup = default_warmup_steps(recorded["schedule"]["total_steps"])
    assert (recorded["second_moment"], recorded["embedding_rows"]) == ("shared", "counts")
    assert recorded["outer"]["preset"] == "average"
    assert recorded["schedule"]["warmup_steps"] == warmup

    conf = yaml.safe_load(config.read_text())
    conf["data"].update(_data_settings(tiny_data))  # as prepared, so only the run is compared

    def check(inner: dict, outer: dict) -> None:
        _check({**conf, "inner": {**conf["inner"], **inner}, "outer": {**conf["outer"], **outer}})

    check({}, {})  # the same config: the run's own settings
    check({"second_moment": "shared", "warmup_steps": warmup},
          {"preset": "average", "embedding_rows": "counts"})  # fmt: skip
    with pytest.raises(ConfigError, match="second_moment: 'shared' -> 'own'"):
        check({"second_moment": "own"}, {})
    with pytest.raises(ConfigError, match="embedding_rows: 'counts' -> 'shares'"):
        check({}, {"embedding_rows": "shares"})


def _workdir(tmp_path: Path, data_dir: Path) -> dict:
    """A config whose data are the prepared test data and whose run.json records its spec."""
    shutil.copytree(data_dir, tmp_path / "data")
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    (tmp_path / "sites.yaml").write_text(yaml.safe_dump(sites))
    overrides = {
        "results": str(tmp_path / "results"),
        "sites_file": str(tmp_path / "sites.yaml"),
        "data": {**_data_settings(data_dir), "dir": str(tmp_path / "data")},
        "rounds": 4,
    }
    config = load_run_config(None, overrides)
    spec = run_spec(config, load_sites(config))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text(json.dumps({"spec": spec.to_dict()}))
    return overrides


def _data_settings(data_dir: Path) -> dict:
    params = json.loads((data_dir / "meta.json").read_text())["params"]
    return {
        "vocab_size": params["vocab_size"],
        "seq_len": params["seq_len"],
        "val_fraction": params["val_fraction"],
        "shards": params["shards"],
    }


def _check(overrides: dict) -> None:
    config = load_run_config(None, overrides)
    check_rerun(config, load_sites(config))


def test_reading_the_workflow_of_a_run_in_progress_imports_no_torch(
    tmp_path: Path, tiny_data: Path
) -> None:
    """Every Snakemake parse (each rerun, and each Slurm job's own) imports what
    rules/*.smk import and checks the rerun against run.json: no torch (seconds per parse,
    minutes on a parallel filesystem), no pandas."""
    overrides = _workdir(tmp_path, tiny_data)
    imports = [
        line
        for smk in sorted((REPO / "rules").glob("*.smk"))
        for line in smk.read_text().splitlines()
        if line.startswith(("from crossfed", "import crossfed"))
    ]
    assert any("check_rerun" in line for line in imports), imports
    code = "\n".join(
        [
            "import json, sys",
            *imports,
            "config = load_run_config(None, json.loads(sys.argv[1]))",
            "check_rerun(config, load_sites(config))",
            "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))",
        ]
    )
    code = code.replace("import ConfigError,", "import ConfigError, load_run_config,")
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(overrides)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_more_rounds_pass_and_finished_rounds_cannot_be_dropped(
    tmp_path: Path, tiny_data: Path
) -> None:
    overrides = _workdir(tmp_path, tiny_data)
    _check(overrides)  # the run as created
    _check({**overrides, "rounds": 10})  # extended
    _check({**overrides, "eval": {"batch": 4}})  # only the coming rounds use it
    merged = tmp_path / "results" / "rounds" / "3" / "merge.json"
    merged.parent.mkdir(parents=True)
    merged.write_text("{}")
    with pytest.raises(ConfigError, match="closed 3 rounds already"):
        _check({**overrides, "rounds": 2})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"data": {"seq_len": 64}}, "data.seq_len: prepared with"),
        ({"data": {"inputs": ["nowhere/c4-train.json.gz"]}}, "data.inputs"),
        ({"data": {"block_size": 2}}, "block_size: 8 -> 2"),
        ({"model": {"flavour": "small"}}, "flavour: 'tiny' -> 'small'"),
        ({"outer": {"eta": 0.5}}, "outer.eta: 0.7 -> 0.5"),
        ({"sites": ["snellius", "lumi"]}, "sites.frontier"),
    ],
)
def test_changes_that_alter_finished_rounds_are_refused(
    tmp_path: Path, tiny_data: Path, change: dict, named: str
) -> None:
    overrides = _workdir(tmp_path, tiny_data)
    merged = {**overrides}
    for key, value in change.items():
        merged[key] = {**overrides.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as refused:
        _check(merged)
    assert named in str(refused.value)
    assert "Nothing was changed" in str(refused.value)


def test_data_changes_is_empty_before_any_preparation(tmp_path: Path) -> None:
    config = load_run_config(None, {"data": {"dir": str(tmp_path / "none")}})
    assert data_changes(config) == []


def test_a_completed_chain_goes_on_when_the_run_is_extended() -> None:
    done = {"next_job": False, "stopped": "run_complete", "next_round": 9}
    assert not chain_continues(done, 8)
    assert chain_continues(done, 10)
    assert chain_continues({"next_job": True, "stopped": "walltime", "next_round": 3}, 8)
    too_short = {"next_job": False, "stopped": "too_short", "next_round": 3}
    assert not chain_continues(too_short, 10)


def test_plan_takes_the_run_length_from_the_config(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.update(rounds=11, sites_file=str(REPO / "config" / "sites.yaml"))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    args = sched_parser().parse_args(
        ["plan", "--config", str(tmp_path / "config.yaml"), "--probes", "p.csv", "--out", "o"]
    )
    sched_cli._from_run_config(args)
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())["sites"]
    windows = sum(s["micro_batch"] * s["ranks"] * s["accumulation"] for s in sites.values())
    assert args.target_units == 11 and args.units_per_round == 1
    assert args.tokens_per_unit == config["inner"]["steps"] * config["data"]["seq_len"] * windows
    assert args.sites == str(REPO / "config" / "sites.yaml")


def test_run_spec_round_trips(tiny_data: Path) -> None:
    spec = tiny_spec(tiny_data)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_round_left_unworked_by_a_pause_gets_its_whole_deadline(
    tmp_path: Path, tiny_data: Path
) -> None:
    """A round's deadline (600 s here) counts only time in which it could be worked on. A
    coordinator restarted an hour after it went down (its sites' leases live on in grace)
    does not close the open round on the first delta to come in, which would make the other
    site's delta of it stale; the deadline then closes it 600 s on, as ever. A run extended
    a day after its last round, on a coordinator that served all along, opens the next
    round's deadline at the extension, not at the end of the round before."""
    staged = staged_delta(tmp_path / "state", tiny_data, seed=1)  # clock at 1000 s
    now, held = staged.now, staged.held
    staged.coord.register("snellius", digest_of(tiny_data), 1, 1.0)
    other = staged.coord.lease("snellius", 1, 2, None, 1.0)["lease"]
    now[0] += 3600.0  # the coordinator was down for an hour
    coord = Coordinator(tmp_path / "state", clock=lambda: now[0])
    coord.submit(
        site="lumi", round_no=1, lease_id=held["lease_id"], generation=0, tokens=100, steps=4,
        consumed=held["n_blocks"], blob=staged.key,
    )  # fmt: skip
    assert coord.tick() is None and coord.status()["round"] == 1  # snellius's lease counts
    for _ in range(12):  # snellius's lease kept alive up to the deadline, 600 s on
        now[0] += 50.0
        coord.heartbeat(other["lease_id"], "snellius", 1, None)
        assert now[0] == 5200.0 or coord.tick() is None
    closed = coord.tick()
    assert closed is not None and closed["reason"] == "deadline"
    assert closed["contributors"] == ["lumi"]

    spec = tiny_spec(tiny_data, schedule=LRSchedule(total_steps=40))
    clock = [5000.0]
    served = Coordinator(tmp_path / "served", clock=lambda: clock[0])
    served.init_run(spec)
    opened = served.current_round()["opened_at"]
    clock[0] += 86400.0  # a day on, the run is extended by more rounds
    served.init_run(replace(spec, schedule=replace(spec.schedule, total_steps=60)))
    assert served.current_round()["opened_at"] == opened  # the record stays as it was
    assert round_pause_s(served.conn, 1) == 86400.0
