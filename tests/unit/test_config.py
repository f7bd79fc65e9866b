"""Run and site config validation: errors that name the file, the place, the value and the fix.

Also the CLI's ``--log``: whatever a failing command says (its config error, a usage error, an
unexpected exception's traceback) and the summaries it prints land in the log file.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from crossfed.cli import main
from crossfed.client.http import Refused
from crossfed.config import ConfigError, check_run, load_run_config, load_sites
from crossfed.coordinator.runspec import RunSpec, RunSpecError
from crossfed.fileio import INLINE_MAX_BYTES
from crossfed.flavours import FLAVOURS, flavour_error
from tests.conftest import REPO, LiveCoordinator, tiny_spec

SITE = {"ranks": 2, "micro_batch": 4, "scheduler": "none", "tokens_per_s_per_gpu": 7000}
SHAPE = {"name": "gcd8-1h", "partition": "standard-g", "nodes": 1, "gpus_per_node": 8,
         "walltime": "01:00:00"}  # fmt: skip
SLURM = {**SITE, "scheduler": "slurm", "max_walltime_h": 48, "qos_max_nodes": 4,
         "shapes": [SHAPE]}  # fmt: skip


def sites_of(tmp_path: Path, sites: dict) -> dict:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump({"sites": sites}, sort_keys=False))
    return load_sites(load_run_config(None, {"sites_file": str(path)}))


def refused(tmp_path: Path, sites: dict) -> str:
    with pytest.raises(ConfigError) as info:
        sites_of(tmp_path, sites)
    return str(info.value)


# ---------------------------------------------------------------------- flavours
def test_the_flavour_list_is_what_the_model_module_builds() -> None:
    from crossfed.train.model import flavour_names

    assert list(FLAVOURS) == flavour_names()
    assert {"tiny", "small", "0.6B"} <= set(FLAVOURS)
    assert not any("moe" in f.lower() or "-A" in f for f in FLAVOURS)


def test_a_wrong_flavour_is_refused_naming_it_and_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, {"model": {"flavour": "0.6b"}})
    message = str(info.value)
    assert "model/flavour" in message and "'0.6b'" in message
    assert "did you mean '0.6B'?" in message
    assert "tiny" in message and "1.7B" in message
    assert flavour_error("30B-A3B") is not None  # mixture-of-experts: not trained
    assert flavour_error("nonsense-xyz").find("did you mean") == -1


def test_a_known_flavour_and_its_settings_are_kept() -> None:
    config = load_run_config(None, {"model": {"flavour": "0.6B", "seed": 3}})
    assert config.model.flavour == "0.6B" and config.model.seed == 3
    assert config.model.device == "cpu"  # defaults still fill in


def test_a_config_key_typo_suggests_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model: unknown key 'flavor' \(did you mean 'flavour'"):
        load_run_config(None, {"model": {"flavor": "tiny"}})


def test_check_run_refuses_a_bad_flavour_and_unknown_here_sites() -> None:
    sites = {"lumi": dict(SITE)}
    config = load_run_config(None, {"here": ["lumi"]})
    check_run(config, sites)
    with pytest.raises(ConfigError, match=r"'here' names unknown sites \['lumj'\]"):
        check_run(replace(config, here=("lumj",)), sites)
    bad = replace(config, model=replace(config.model, flavour="Tiny"))
    with pytest.raises(ConfigError, match=r"workflow config: model/flavour: .*did you mean 'tiny'"):
        check_run(bad, sites)


def test_run_spec_refuses_an_unknown_flavour(tiny_data: Path) -> None:
    spec = tiny_spec(tiny_data).to_dict()
    assert RunSpec.from_dict(spec).flavour == "tiny"
    with pytest.raises(RunSpecError, match=r"'0\.6b' \(did you mean '0\.6B'\?\)"):
        RunSpec.from_dict({**spec, "flavour": "0.6b"})


def test_run_spec_refuses_a_probe_share_outside_zero_to_one(tiny_data: Path) -> None:
    spec = tiny_spec(tiny_data).to_dict()
    for good in (0.25, 1.0):
        spec["leases"]["probe_share"] = good
        assert RunSpec.from_dict(spec).leases.probe_share == good
    for bad in (0.0, -0.1, 1.5):
        spec["leases"]["probe_share"] = bad
        with pytest.raises(RunSpecError, match=r"probe_share must be in \(0, 1\]"):
            RunSpec.from_dict(spec)
    old = tiny_spec(tiny_data).to_dict()
    del old["leases"]["probe_share"]  # a run stored before the field existed
    assert RunSpec.from_dict(old).leases.probe_share == 0.25


def test_the_coordinator_answers_a_bad_flavour_with_422_and_the_reason(
    coordinator: LiveCoordinator, tiny_data: Path
) -> None:
    spec = {**tiny_spec(tiny_data).to_dict(), "flavour": "0.6b"}
    with pytest.raises(Refused) as info:
        coordinator.client().init_run(spec)
    assert info.value.status == 422 and info.value.code == "bad_run_spec"
    assert "'0.6b'" in info.value.detail and "did you mean '0.6B'" in info.value.detail
    with pytest.raises(Refused, match="no_run|404"):  # nothing was created
        coordinator.client().status()


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("data_seed", -1, r"seed must be in \[0, 18446744073709551616\), got -1"),
        ("data_seed", 1 << 64, r"seed must be in \[0, "),
        ("n_windows", 1 << 40, r"too many blocks"),
    ],
)
def test_a_block_space_the_coordinator_cannot_hold_is_422_and_creates_nothing(
    coordinator: LiveCoordinator, tiny_data: Path, field: str, value: int, reason: str
) -> None:
    spec = {**tiny_spec(tiny_data).to_dict(), field: value, "block_size": 1}
    with pytest.raises(Refused) as info:
        coordinator.client().init_run(spec)
    assert info.value.status == 422 and info.value.code == "bad_run_spec"
    assert re.search(reason, info.value.detail), info.value.detail
    with pytest.raises(Refused, match="no_run|404"):  # nothing was created
        coordinator.client().status()
    coordinator.client().init_run(tiny_spec(tiny_data).to_dict())  # and a good one still can
    assert coordinator.client().status()["generation"] == 0


# ---------------------------------------------------------------------- sites
@pytest.mark.parametrize(
    "path", ["config/sites.yaml", "profiles/slurm/sites.yaml"], ids=["config", "slurm"]
)
def test_every_sites_file_in_the_repo_validates_and_keeps_its_values(path: str) -> None:
    raw = yaml.safe_load((REPO / path).read_text())["sites"]
    sites = load_sites(load_run_config(None, {"sites_file": str(REPO / path)}))
    assert list(sites) == list(raw)
    for name, site in raw.items():
        for key, value in site.items():
            assert sites[name][key] == value, (name, key)


def test_a_site_key_typo_is_refused_naming_site_and_key(tmp_path: Path) -> None:
    site = {**SITE, "rank": 2}
    del site["ranks"]
    message = refused(tmp_path, {"lumi": site})
    assert "sites/lumi: unknown key 'rank' (did you mean 'ranks'?)" in message
    assert "sites/lumi: missing required key 'ranks'" in message
    assert str(tmp_path / "sites.yaml") in message


def test_a_scheduler_typo_is_refused_with_the_allowed_values(tmp_path: Path) -> None:
    message = refused(tmp_path, {"lumi": {**SITE, "scheduler": "slrum"}})
    assert "sites/lumi/scheduler: 'slrum' is not one of none, slurm (did you mean 'slurm'?)" in (
        message
    )
    message = refused(tmp_path, {"lumi": {**SITE, "transport": "NAT-ed"}})
    assert "sites/lumi/transport" in message and "direct, nat, proxy" in message


@pytest.mark.parametrize("key", ["ranks", "micro_batch", "scheduler", "tokens_per_s_per_gpu"])
def test_required_site_keys_are_required(tmp_path: Path, key: str) -> None:
    site = {k: v for k, v in SITE.items() if k != key}
    assert f"sites/snellius: missing required key '{key}'" in refused(tmp_path, {"snellius": site})


@pytest.mark.parametrize("key", ["shapes", "max_walltime_h", "qos_max_nodes"])
def test_a_slurm_site_needs_shapes_and_limits(tmp_path: Path, key: str) -> None:
    site = {k: v for k, v in SLURM.items() if k != key}
    message = refused(tmp_path, {"lumi": site})
    assert "sites/lumi" in message and key in message
    assert "slurm site" in message


def test_a_slurm_site_with_an_empty_shape_list_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, {"lumi": {**SLURM, "shapes": []}})
    assert "sites/lumi/shapes" in message and "at least one job shape" in message


def test_a_local_site_needs_no_shapes_or_limits_and_gets_defaults(tmp_path: Path) -> None:
    site = sites_of(tmp_path, {"laptop": dict(SITE)})["laptop"]
    assert site["shapes"] == [] and site["accumulation"] == 1 and site["transport"] == "direct"
    assert site["ranks"] == 2 and site["tokens_per_s_per_gpu"] == 7000


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"gpus": 8}, "sites/lumi/shapes/0: unknown key 'gpus'"),
        ({"partition": ""}, "sites/lumi/shapes/0/partition: '' should be non-empty"),
        ({"nodes": 0}, "sites/lumi/shapes/0/nodes: 0 is less than the minimum of 1"),
        ({"gpus_per_node": 0}, "sites/lumi/shapes/0/gpus_per_node: 0 is less than the minimum"),
        ({"walltime": "8h"}, "sites/lumi/shapes/0/walltime: '8h' is not a Slurm time limit"),
        ({"walltime": "00:00:00"}, "'00:00:00' is not a Slurm time limit above zero"),
        ({"walltime": "1-00:60:00:00"}, "'1-00:60:00:00' is not a Slurm time limit"),
    ],
)
def test_bad_shapes_are_refused_naming_the_shape_key(
    tmp_path: Path, change: dict, expected: str
) -> None:
    site = {**SLURM, "shapes": [{**SHAPE, **change}]}
    assert expected in refused(tmp_path, {"lumi": site})


@pytest.mark.parametrize("walltime", ["60", "30:00", "08:00:00", "2-00", "2-12:00", "1-12:00:00"])
def test_every_slurm_walltime_form_is_accepted(tmp_path: Path, walltime: str) -> None:
    site = {**SLURM, "shapes": [{**SHAPE, "walltime": walltime}]}
    assert sites_of(tmp_path, {"lumi": site})["lumi"]["shapes"][0]["walltime"] == walltime


def test_shape_names_must_be_unique(tmp_path: Path) -> None:
    site = {**SLURM, "shapes": [SHAPE, {**SHAPE, "walltime": "02:00:00"}]}
    assert "sites/lumi/shapes: shape names used twice: ['gcd8-1h']" in refused(
        tmp_path, {"lumi": site}
    )


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    message = refused(
        tmp_path, {"lumi": {**SITE, "rank": 1}, "snellius": {**SITE, "scheduler": "pbs"}}
    )
    assert "sites/lumi: unknown key 'rank'" in message and "sites/snellius/scheduler" in message


# ---------------------------------------------------------------------- CLI --log
def write_config(tmp_path: Path, **model) -> Path:
    config = {
        "results": str(tmp_path / "results"),
        "sites_file": str(REPO / "config" / "sites.yaml"),
        "model": model,
        "coordinator": {"url": "http://127.0.0.1:9"},  # remote: nothing to start
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_log_holds_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, flavour="0.6b")
    log = tmp_path / "logs" / "status.log"
    assert main(["--log", str(log), "status", "--config", str(config)]) == 2
    text = log.read_text()
    assert "crossfed: config error:" in text and "unknown model flavour '0.6b'" in text
    assert "did you mean '0.6B'" in text
    assert "unknown model flavour '0.6b'" in capsys.readouterr().err  # the terminal too


def test_log_holds_what_a_command_prints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, flavour="tiny")
    log = tmp_path / "start.log"
    log.write_text("earlier attempt\n")
    assert main(["--log", str(log), "coordinator", "start", "--config", str(config)]) == 0
    text = log.read_text()
    assert text.startswith("earlier attempt\n")  # appended, never truncated
    assert "coordinator is remote (http://127.0.0.1:9); nothing to start" in text
    assert "nothing to start" in capsys.readouterr().out


def test_log_holds_a_usage_error(tmp_path: Path) -> None:
    log = tmp_path / "usage.log"
    with pytest.raises(SystemExit) as info:
        main(["--log", str(log), "status", "--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in log.read_text()


def test_log_holds_an_unexpected_exception_with_its_traceback(tmp_path: Path) -> None:
    config = write_config(tmp_path, flavour="tiny")
    model = tmp_path / "global-1.safetensors"
    model.write_bytes(b"not a safetensors file")
    log = tmp_path / "export.log"
    argv = ["--log", str(log), "export", "--config", str(config), "--model", str(model)]
    with pytest.raises(Exception) as info:
        main([*argv, "--out", str(tmp_path / "hf")])
    text = log.read_text()
    assert "Traceback (most recent call last)" in text
    assert type(info.value).__name__ in text and "cmd_export" in text


def test_without_log_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, flavour="0.6b")
    assert main(["status", "--config", str(config)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_negative_block_seed_is_refused_at_read() -> None:
    with pytest.raises(ConfigError, match=r"data/seed: -1 is less than the minimum of 0"):
        load_run_config(None, {"data": {"seed": -1}})


def test_nested_command_line_values_arrive_typed() -> None:
    """`--config data="{'seq_len': 64}"` reaches the config as strings (YAML's base loader)."""
    from crossfed.config import load_run_config

    config = load_run_config(
        None,
        {"data": {"seq_len": "64", "inputs": ["7"], "tokenizer": "null"},
         "model": {"compile": "true"}, "transport": {"inline_max_bytes": "0"}},
    )  # fmt: skip
    assert config.data.seq_len == 64
    assert config.data.inputs == ("7",)  # a path stays a string
    assert config.data.tokenizer == "null"  # string or null: a string is a string
    assert config.model.compile is True and config.transport.inline_max_bytes == 0
    with pytest.raises(ConfigError, match="seq_len"):
        load_run_config(None, {"data": {"seq_len": "sixty"}})


def test_the_inline_limit_is_one_number_in_the_schema_the_shipped_config_and_the_code() -> None:
    """``transport.inline_max_bytes``: the schema's default (a literal, as a JSON-schema
    default must be), config/config.yaml's value and ``crossfed.fileio.INLINE_MAX_BYTES`` (the
    site's default) are the same 2 GiB, so none of them can drift from the others."""
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    default = schema["properties"]["transport"]["properties"]["inline_max_bytes"]["default"]
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert default == shipped["transport"]["inline_max_bytes"] == INLINE_MAX_BYTES == 2 * 1024**3
    assert load_run_config(None).transport.inline_max_bytes == INLINE_MAX_BYTES


def test_an_outer_preset_typo_is_refused_naming_it_and_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, {"outer": {"preset": "averag"}})
    message = str(info.value)
    assert "outer/preset" in message and "'averag'" in message
    assert all(name in message for name in ("average", "paper", "tuned"))
    assert load_run_config(None, {"outer": {"preset": "average"}}).outer.preset == "average"


def test_the_schema_offers_exactly_the_outer_presets_the_code_runs() -> None:
    from crossfed.outer_presets import PRESET_NAMES

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    enum = schema["properties"]["outer"]["properties"]["preset"]["enum"]
    assert sorted(x for x in enum if x is not None) == sorted(PRESET_NAMES)


# ---------------------------------------------------------------------- transfer streams
def test_transfer_streams_come_from_the_config_and_a_site_may_set_its_own(
    tmp_path: Path,
) -> None:
    from crossfed.client.reach import client_for

    sites = tmp_path / "sites.yaml"
    sites.write_text(
        yaml.safe_dump({"sites": {"frontier": {**SITE, "streams": 16}, "lumi": dict(SITE)}})
    )
    (tmp_path / "secrets.yaml").write_text(
        yaml.safe_dump({"admin": "a", "sites": {"frontier": "f", "lumi": "l"}})
    )
    config = load_run_config(None, {"sites_file": str(sites)})
    assert config.transport.streams == 8  # the default
    coordinator = replace(
        config.coordinator, url="http://127.0.0.1:9", secrets=str(tmp_path / "secrets.yaml")
    )
    config = replace(config, coordinator=coordinator)
    streams = {who: client_for(config, who).streams for who in ("frontier", "lumi", "admin")}
    assert streams == {"frontier": 16, "lumi": 8, "admin": 8}
    config = replace(config, transport=replace(config.transport, streams=2))
    assert client_for(config, "lumi").streams == 2
    assert "sites/lumi/streams: 0 is less than the minimum of 1" in refused(
        tmp_path, {"lumi": {**SITE, "streams": 0}}
    )
    with pytest.raises(ConfigError, match="transport/streams"):
        load_run_config(None, {"transport": {"streams": 0}})


def test_one_loader_reads_a_sites_file_for_the_run_and_for_the_scheduler(tmp_path: Path) -> None:
    """The run and `crossfed probe/plan --sites` read a sites file with one schema-checked
    loader: a number YAML 1.1 reads as a string is a number for both, the planner block is
    known to both, and a site's unknown key is refused by the run, kept by the scheduler."""
    from crossfed.config import read_sites, read_sites_file

    path = tmp_path / "sites.yaml"
    path.write_text(
        "sites:\n  lumi:\n    ranks: 2\n    micro_batch: 4\n    scheduler: none\n"
        "    tokens_per_s_per_gpu: 1.2e4\n    note_for_later: {kept: true}\n"
        "planner:\n  target_tokens: 1.0e+10\n  units_per_round: 5\n"
    )
    run_config = load_run_config(None, {"sites_file": str(path)})
    with pytest.raises(ConfigError, match=r"sites/lumi: unknown key 'note_for_later'"):
        load_sites(run_config)
    kept = read_sites_file(path)["lumi"]
    assert kept.tokens_per_s_per_gpu == 12000.0 and kept.extra == {"note_for_later": {"kept": True}}
    assert kept.accumulation == 1 and kept["shapes"] == []  # the schema's defaults filled in
    path.write_text(path.read_text().replace("    note_for_later: {kept: true}\n", ""))
    run_site = load_sites(run_config)["lumi"]
    assert run_site.tokens_per_s_per_gpu == 12000.0 and run_site.extra == {}
    assert read_sites(path).planner == {"target_tokens": 1.0e10, "units_per_round": 5}
    path.write_text(path.read_text().replace("units_per_round: 5", "units_per_round: -5"))
    with pytest.raises(ConfigError, match=r"planner/units_per_round: -5 is less than or equal"):
        read_sites(path)
