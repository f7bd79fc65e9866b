"""The command line explains itself: every command's --help says what it does with an example,
a bare ``crossfed`` prints the help, ``--version`` answers; ``coordinator secrets`` writes the
tokens file a real coordinator serves with."""

from __future__ import annotations

import argparse
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import crossfed
from crossfed.cli import build_parser, main
from crossfed.client.http import CoordinatorClient, Refused
from crossfed.coordinator.embedded import ServeCommand, free_port, spawn_coordinator
from tests.conftest import REPO, stop, write_yaml


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple]:
    """Every command path under ``parser`` (groups and their actions alike; an alias, such
    as `checkpoint` for `evaluate`, is the same command under its first name)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, child in action.choices.items():
                if id(child) in seen:
                    continue
                seen.add(id(child))
                found.append((*path, name))
                found += commands(child, (*path, name))
    return found


def parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[name]
    return parser


ALL = commands(build_parser())


def test_the_commands_are_all_walked() -> None:
    for expected in [("coordinator", "secrets"), ("export",), ("plan", "simulate"), ("data",)]:
        assert expected in ALL
    assert len(ALL) >= 20


@pytest.mark.parametrize("path", ALL, ids=" ".join)
def test_every_command_help_says_what_it_does_with_an_example(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: crossfed {' '.join(path)}")
    parser = parser_of(path)
    assert parser.description and parser.description.strip() in text
    examples = text.split("\nexample")[1]  # "examples:" or "example:"
    assert f"crossfed {' '.join(path)}" in examples
    unexplained = [
        a.option_strings for a in parser._actions if a.option_strings and not (a.help or "")
    ]
    assert not unexplained, f"options without help: {unexplained}"


def test_defaults_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    for path, shown in [
        (["export"], "dtype of the exported weights (default: bfloat16)"),
        (["round", "wait"], "0: wait until it closes (default: 0)"),
        (["coordinator", "serve"], "TCP port to listen on (default: 8470)"),
        (["checkpoint"], "the round that made it (0: the initial model)"),
    ]:
        with pytest.raises(SystemExit):
            main([*path, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split())


def test_bare_crossfed_and_bare_groups_print_their_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: crossfed") and "commands:" in text and "export" in text
    assert main(["coordinator"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: crossfed coordinator") and "secrets" in text
    with pytest.raises(SystemExit) as done:  # a typo is still a usage error
        main(["exprot"])
    assert done.value.code == 2
    assert "invalid choice: 'exprot'" in capsys.readouterr().err


def test_the_installed_command_bare_and_its_version() -> None:
    crossfed_bin = Path(sys.executable).with_name("crossfed")
    bare = subprocess.run([crossfed_bin], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bare.returncode == 0 and bare.stdout.startswith("usage: crossfed"), bare.stderr
    shown = subprocess.run(
        [crossfed_bin, "--version"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert shown.returncode == 0
    assert shown.stdout.strip() == f"crossfed {crossfed.__version__}"
    assert crossfed.__version__ == version("crossfed")  # the package's own metadata


# ---------------------------------------------------------------------- coordinator secrets
def test_a_serve_command_gives_the_cli_every_setting_and_leaves_unset_ones_to_its_defaults(
    tmp_path: Path,
) -> None:
    full = ServeCommand(tmp_path / "state", tmp_path / "s.yaml", "0.0.0.0", 9001, 2.5, 7,
                        tmp_path / "blobs.yaml", "http://worker:8471")  # fmt: skip
    args = build_parser().parse_args(full.argv())
    assert (args.state_dir, args.secrets) == (str(tmp_path / "state"), str(tmp_path / "s.yaml"))
    assert (args.host, args.port, args.max_request_s) == ("0.0.0.0", 9001, 2.5)
    assert (args.ledger_checkpoint_every, args.blobs) == (7, str(tmp_path / "blobs.yaml"))
    assert args.merge_worker == "http://worker:8471"
    assert full.log_path == tmp_path / "state" / "coordinator.log"
    bare = build_parser().parse_args(ServeCommand(tmp_path, tmp_path / "s.yaml", "h", 1).argv())
    required = ["--state-dir", str(tmp_path), "--secrets", "s.yaml"]
    defaults = build_parser().parse_args(["coordinator", "serve", *required])
    for unset in ("max_request_s", "ledger_checkpoint_every", "blobs", "merge_worker"):
        assert getattr(bare, unset) == getattr(defaults, unset)


def test_secrets_are_written_private_and_a_coordinator_serves_them(tmp_path: Path) -> None:
    path = tmp_path / "vm" / "secrets.yaml"
    argv = ["coordinator", "secrets", "--out", str(path), "--site", "snellius", "--site", "lumi"]
    assert main(argv) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = yaml.safe_load(path.read_text())
    tokens = [data["admin"], *data["sites"].values()]
    assert set(data["sites"]) == {"snellius", "lumi"}
    assert len(set(tokens)) == 3 and all(len(t) >= 40 for t in tokens)

    port = free_port("127.0.0.1")
    state = tmp_path / "state"
    state.mkdir()
    process = spawn_coordinator(ServeCommand(state, path, "127.0.0.1", port), 240)
    try:
        url = f"http://127.0.0.1:{port}"
        for token in tokens:  # each token is known: the answer is about the run, not the caller
            with pytest.raises(Refused) as refused:
                CoordinatorClient(url, token, retry_budget_s=10).status()
            assert refused.value.code == "no_run"
        with pytest.raises(Refused) as refused:
            CoordinatorClient(url, "not-a-token", retry_budget_s=10).status()
        assert refused.value.code == "unauthenticated"
    finally:
        stop(process)


def test_secrets_extend_a_file_and_keep_its_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "secrets.yaml"
    assert main(["coordinator", "secrets", "--out", str(path), "--site", "lumi"]) == 0
    before = yaml.safe_load(path.read_text())
    path.chmod(0o644)  # loosened by hand
    capsys.readouterr()
    argv = ["coordinator", "secrets", "--out", str(path), "--site", "lumi", "--site", "frontier"]
    assert main(argv) == 0
    after = yaml.safe_load(path.read_text())
    assert after["admin"] == before["admin"] and after["sites"]["lumi"] == before["sites"]["lumi"]
    assert set(after["sites"]) == {"lumi", "frontier"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert str(path) in out and "new: frontier" in out and "mode 0600" in out
    assert main(["coordinator", "secrets", "--out", str(path), "--site", "lumi"]) == 0
    assert "nothing new, every token kept" in capsys.readouterr().out
    assert yaml.safe_load(path.read_text()) == after


def test_secrets_sites_default_to_the_run_config(tmp_path: Path) -> None:
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    config = write_yaml(
        tmp_path / "config.yaml", {"sites_file": str(REPO / "config" / "sites.yaml")}
    )
    path = tmp_path / "secrets.yaml"
    assert main(["coordinator", "secrets", "--out", str(path), "--config", str(config)]) == 0
    assert set(yaml.safe_load(path.read_text())["sites"]) == set(sites["sites"])


@pytest.mark.parametrize(
    "content, problem",
    [
        ("- admin\n- lumi\n", "a mapping with 'admin' and 'sites' expected, found a list"),
        ("admin: x\nsites: [lumi]\n", "'sites' must map site names to tokens"),
        ("admin: x\nsites: {lumi: 3}\n", "the tokens of sites ['lumi'] are not strings"),
        ("admin: [x\n", "not YAML"),
    ],
)
def test_a_secrets_file_that_is_not_one_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    path = tmp_path / "secrets.yaml"
    path.write_text(content)
    assert main(["coordinator", "secrets", "--out", str(path), "--site", "lumi"]) == 2
    err = capsys.readouterr().err
    assert problem in err and "left as it is" in err
    assert path.read_text() == content


@pytest.mark.parametrize("name", ["admin", "Lumi", "", "lumi site"])
def test_secrets_refuse_names_that_are_not_site_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = tmp_path / "secrets.yaml"
    with pytest.raises(SystemExit) as done:
        main(["coordinator", "secrets", "--out", str(path), "--site", name])
    assert done.value.code == 2
    assert "is not a site name" in capsys.readouterr().err
    assert not path.exists()
