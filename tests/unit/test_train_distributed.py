"""torchrun with 2 CPU ranks (gloo, torchtitan's FSDP2) trains the same inner phase as one
process simulating 2 ranks: the same windows, the same losses and weights, and exactly the
leased windows, each once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crossfed.train.distributed import (
    DistributedError,
    full_parameters,
    load_full_parameters,
    torchrun_argv,
)
from crossfed.train.inner import LeaseWindows

REPO = Path(__file__).resolve().parents[2]
RANGES = [(0, 20), (300, 311), (64, 72)]  # 39 windows: 4 steps of 12, the last one short (3)


def _standalone(tmp_path: Path, data: Path, name: str, torchrun: bool) -> tuple[dict, dict]:
    args = [
        "--data",
        str(data),
        "--ranges",
        ",".join(f"{a}:{b}" for a, b in RANGES),
        "--ranks",
        "2",
        "--accumulation",
        "2",
        "--micro-batch",
        "3",
        "--out",
        str(tmp_path / f"{name}.json"),
        "--params-out",
        str(tmp_path / f"{name}.safetensors"),
    ]
    module = ["-m", "crossfed.train.standalone"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", *module, *args]
    else:
        cmd = [sys.executable, *module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    return result, load_file(str(tmp_path / f"{name}.safetensors"))


@pytest.mark.slow
def test_torchrun_fsdp_matches_the_single_process_simulation(
    tiny_data: Path, tmp_path: Path
) -> None:
    simulated, sim_params = _standalone(tmp_path, tiny_data, "simulated", torchrun=False)
    real, real_params = _standalone(tmp_path, tiny_data, "torchrun", torchrun=True)
    leased = LeaseWindows.of(RANGES).indices(0, 39)

    assert simulated["world"] == 1 and real["world"] == 2
    assert real["steps"] == simulated["steps"] == 4
    assert real["windows"] == simulated["windows"] == 39
    assert real["losses"] == pytest.approx(simulated["losses"], rel=1e-5)
    by_rank = real["windows_by_rank"]
    union = [w for rank in by_rank for w in rank]
    assert sorted(union) == sorted(leased) and len(set(union)) == len(union)
    assert not set(by_rank[0]) & set(by_rank[1])
    assert sorted(simulated["windows_by_rank"][0]) == sorted(leased)
    assert set(real_params) == set(sim_params)
    for name, value in real_params.items():
        assert torch.allclose(value, sim_params[name], atol=1e-5), name


def test_full_parameters_is_a_copy_that_later_steps_leave_alone() -> None:
    """On CPU a parameter's ``.cpu()`` is the parameter itself: the weights a site keeps for
    its fold-in must not move with the model (they did, and an overlapped phase that folded
    at its end sent a delta of zeros)."""
    model = torch.nn.Linear(4, 3)
    kept = full_parameters(model)
    before = {name: value.clone() for name, value in kept.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert all(torch.equal(kept[name], before[name]) for name in kept)
    assert not torch.equal(model.weight.detach(), before["weight"])  # the model moved
    load_full_parameters(model, kept)  # and the copy restores it
    assert torch.equal(model.weight.detach(), before["weight"])
    on_device = full_parameters(model, cpu=False)
    assert on_device["weight"].data_ptr() != model.weight.data_ptr()


def test_torchrun_command_for_one_node_and_for_several() -> None:
    one = torchrun_argv(4, ["site", "run", "--site", "lumi"])
    assert one[:3] == ["torchrun", "--standalone", "--nnodes=1"]
    assert one[-7:] == ["-m", "--", "crossfed", "site", "run", "--site", "lumi"]
    assert "--nproc-per-node=4" in one
    many = torchrun_argv(8, ["site", "run"], nnodes=2, rdzv_endpoint="nid001:29500")
    assert "--rdzv-endpoint=nid001:29500" in many and "--nnodes=2" in many
    with pytest.raises(DistributedError, match="rendezvous"):
        torchrun_argv(8, ["site", "run"], nnodes=2)


def test_torchrun_hands_crossfed_its_own_options() -> None:
    """torchrun's parser passes crossfed's arguments through, `--log` first (the rules' order)."""
    from torch.distributed.run import get_args_parser

    argv = ["--log", "results/logs/train/lumi-job1.log", "site", "run", "--site", "lumi"]
    cmd = torchrun_argv(2, argv)
    assert cmd[0] == "torchrun"
    parsed = get_args_parser().parse_args(cmd[1:])
    assert parsed.module and parsed.training_script == "crossfed"
    assert parsed.training_script_args == argv
    assert parsed.nproc_per_node == "2"


def test_the_evaluation_device_resolves_or_fails_naming_the_setting(tmp_path: Path) -> None:
    import yaml

    from crossfed.train.distributed import resolve_device

    gpu = torch.cuda.is_available()
    assert resolve_device("auto", "eval.device") == ("cuda" if gpu else "cpu")
    assert resolve_device("cpu", "eval.device") == "cpu"
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())

    def checkpoint_with(device: str) -> subprocess.CompletedProcess:
        config["eval"]["device"] = device
        path = tmp_path / f"config-{device}.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "crossfed", "checkpoint", "--config", str(path)]
        cmd += ["--generation", "0", "--model-out", str(tmp_path / "g0.safetensors")]
        cmd += ["--out", str(tmp_path / "eval.json")]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    bad = checkpoint_with("tpu9")
    assert bad.returncode == 2 and "eval/device" in bad.stderr and "tpu9" in bad.stderr
    if not gpu:
        with pytest.raises(DistributedError, match="eval.device is 'cuda'"):
            resolve_device("cuda", "eval.device")
        missing = checkpoint_with("cuda")
        assert missing.returncode == 2, missing.stderr
        assert "eval.device is 'cuda' but torch sees no GPU" in missing.stderr
