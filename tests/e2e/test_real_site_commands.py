"""The real-site commands of docs/real-site.md, run as written, against the test Slurm cluster.

A copy of the checkout stands in for a LUMI login node's clone, with the venv this test
runs from as its ``.venv`` (the page's ``python -m venv .venv && pip install -e .``). The
user's edits of the CHANGE-ME values are made the way a user makes them: the account,
partitions and memory for the test cluster's nodes, the coordinator's URL, the image, and
a tiny run (``model.device: cpu``, since the test nodes have no GPU). The commands of
"3. Each site" then run literally with a ``PATH`` of ``/usr/bin:/bin`` and the stand-in for
``apptainer`` only (tests/helpers/standins/apptainer runs the command without a container; its
"image" is a folder whose ``bin/crossfed`` records each call), so nothing can find the
venv's crossfed through ``PATH``. The coordinator of "1. The coordinator VM" runs from its
own copy of the checkout: the page's secrets command and ``run init`` as written, the
server without TLS on a loopback port.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from crossfed.coordinator.embedded import free_port
from tests.helpers.slurm_cluster import SlurmTestCluster, slurm_cluster  # noqa: F401 (the session fixture)
from tests.helpers.workflow import (
    BARE_PATH,
    REAL_SITE,
    VENV,
    background,
    bash,
    bash_blocks,
    checkout,
    command,
    commands,
    edit_yaml,
    output_of,
    small_run,
    stand_in_image,
    wait_for,
)

CONFIG = Path("results/.crossfed/config.yaml")


def plus(line: str, *args: str) -> str:
    """A documented line with more arguments (before its comment)."""
    return " ".join([line.split("#")[0].strip(), *args])


def user_edits(site: Path, cluster: SlurmTestCluster, url: str, image: Path) -> None:
    """The page's "edit ..." steps, filled in for the test cluster and a tiny run."""

    def profile(p: dict) -> None:
        # evaluation on a GPU partition the site does not train on (LUMI: small-g); data
        # preparation stays on the CPU partition (LUMI-C small, here: small)
        p["default-resources"].update(
            slurm_account=cluster.account, slurm_partition="snellius", mem_mb=500, cpus_per_task=1
        )
        p["set-resources"]["prepare_data"].update(cpus_per_task=1, mem_mb=500, runtime=10)
        p["set-resources"]["train_job"].update(cpus_per_task=1, mem_mb=500)
        p["set-threads"] = {"train_job": 1, "evaluate": 1}
        # the test cluster answers at once: poll it every second, not every minute
        p.update({"latency-wait": 5, "slurm-init-seconds-before-status-checks": 1,
                  "seconds-between-status-checks": 1})  # fmt: skip

    def overlay(c: dict) -> None:
        c["model"]["device"] = "cpu"  # no GPU on the test nodes
        c["software"]["container"] = str(image)
        c["coordinator"]["url"] = url
        c["chain"] = {"margin_s": 15, "round_prior_s": 10}

    def sites(s: dict) -> None:  # this run's one site: lumi, on the test cluster's partition
        lumi = s["sites"]["lumi"]
        lumi.update(account=cluster.account, ranks=1, micro_batch=4, rtt_ms=0,
                    max_walltime_h=0.1, tokens_per_s_per_gpu=1000, slowdown=5.0)  # fmt: skip
        lumi["shapes"] = [{"name": "gcd1-5m", "partition": "lumi", "nodes": 1,
                           "gpus_per_node": 1, "walltime": "00:05:00"}]  # fmt: skip
        s["sites"] = {"lumi": lumi}

    def run(c: dict) -> None:
        small_run(c, 2, steps=4, max_windows=32, join_window_s=2)

    edit_yaml(site / "profiles" / "lumi" / "config.yaml", profile)
    edit_yaml(site / "profiles" / "lumi" / "crossfed.yaml", overlay)
    edit_yaml(site / "profiles" / "slurm" / "sites.yaml", sites)
    edit_yaml(site / "config" / "config.yaml", run)


def test_dry_runs_find_the_profile_and_write_nothing(tmp_path: Path) -> None:
    """Every documented form of the dry run works from the root without the venv on PATH."""
    site = checkout(tmp_path / "site")
    env = {"HOME": str(tmp_path / "home"), "PATH": BARE_PATH}
    assert shutil.which("crossfed", path=BARE_PATH) is None
    assert shutil.which("snakemake", path=BARE_PATH) is None
    each_site = bash_blocks("## 3. Each site", REAL_SITE)[0]
    dry = command(each_site, ".venv/bin/snakemake --profile lumi -n")
    forms = [
        dry,
        ".venv/bin/snakemake --profile profiles/lumi -n",
        ". .venv/bin/activate && snakemake --profile lumi -n",
        ".venv/bin/snakemake --profile snellius -n",
        ".venv/bin/snakemake --profile frontier -n",
        ".venv/bin/snakemake --profile profiles/local -n",
    ]
    for form in forms:
        out = bash(form, site, env, timeout_s=300)
        assert "This was a dry-run" in out, (form, out[-3000:])
        assert not (site / "results").exists(), form  # nothing written, CONFIG included
    # the jobs' commands: the venv's Python on the host, the image's crossfed under apptainer
    out = bash(plus(dry, "-p"), site, env, timeout_s=300)
    python = f"{VENV / 'bin' / 'python'}"
    assert re.search(rf"{re.escape(python)}\S* -m crossfed --log \S+ round wait", out), out
    assert re.search(r"Shell command: crossfed --log \S+ site run --config", out), out
    assert re.search(r"Shell command: crossfed --log \S+ data prepare", out), out
    out = bash(".venv/bin/snakemake --profile snellius -n -p", site, env, timeout_s=300)
    assert re.search(rf"{re.escape(python)}\S* -m crossfed --log \S+ site run", out), out


@pytest.mark.slurm
@pytest.mark.slow
def test_readme_site_commands_run_against_slurm(
    tmp_path: Path,
    slurm_cluster: SlurmTestCluster,  # noqa: F811
) -> None:
    cluster = slurm_cluster
    site, vm = checkout(tmp_path / "site"), checkout(tmp_path / "vm")
    image = stand_in_image(tmp_path / "crossfed-rocm.sif")
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    user_edits(site, cluster, url, image)
    for name in ("config/config.yaml", "profiles/slurm/sites.yaml"):  # the same at the VM
        shutil.copy2(site / name, vm / name)

    # 1. the coordinator VM: the secrets command as written, the server on loopback
    vm_env = {"HOME": str(tmp_path / "home"), "PATH": f"{VENV / 'bin'}:/usr/bin:/bin"}
    setup, init = bash_blocks("## 1. The coordinator VM", REAL_SITE)
    (make_secrets,) = commands(setup, "crossfed coordinator secrets --out secrets.yaml")
    bash(make_secrets, vm, vm_env)
    assert (vm / "secrets.yaml").stat().st_mode & 0o777 == 0o600
    secrets = yaml.safe_load((vm / "secrets.yaml").read_text())
    assert set(secrets["sites"]) == {"snellius", "lumi", "frontier"}
    (serve,) = commands(setup, "crossfed coordinator serve")
    assert serve.startswith("crossfed coordinator serve --state-dir state --secrets secrets.yaml")
    server = subprocess.Popen(
        ["crossfed", "coordinator", "serve", "--state-dir", "state", "--secrets",
         "secrets.yaml", "--host", "127.0.0.1", "--port", str(port)],
        cwd=vm, env=vm_env, stdout=open(tmp_path / "serve.out", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        run_site(site, vm, cluster, tmp_path, url, init, secrets, vm_env, image)
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_site(site, vm, cluster, tmp_path, url, init, secrets, vm_env, image) -> None:
    site_env = {
        "HOME": str(tmp_path / "home"),
        "PATH": BARE_PATH,
        "SLURM_CONF": cluster.env["SLURM_CONF"],
        "PYTHONUNBUFFERED": "1",
    }
    (each_site,) = bash_blocks("## 3. Each site", REAL_SITE)
    (export,) = commands(each_site, "export CROSSFED_TOKEN=")
    run = command(each_site, ".venv/bin/snakemake --profile lumi")
    dry = command(each_site, ".venv/bin/snakemake --profile lumi -n")
    token = export.replace("<this site's token>", secrets["sites"]["lumi"])

    # the first site prepares the data (a Slurm job); the VM creates the run from it
    data_step = command(init, ".venv/bin/snakemake --profile lumi results/data/meta.json")
    bash(f"{token} && {data_step}", site, site_env)
    (vm / "results" / "data").mkdir(parents=True)
    shutil.copy2(site / "results" / "data" / "meta.json", vm / "results" / "data")
    lines = init.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("CROSSFED_TOKEN="))
    run_init = "\n".join(lines[first:])
    run_init = run_init.replace("<admin token>", secrets["admin"])
    run_init = run_init.replace("https://crossfed.example.org", url)
    assert "run created" in bash(run_init, vm, vm_env)

    # 3. each site: the dry run, then the run itself, both as written
    bash(f"{token} && {dry}", site, site_env)
    proc = background(["/bin/bash", "-c", f"{token} && {run}"], site, site_env,
                      tmp_path / "site.out")  # fmt: skip
    try:
        # the modification time of the effective config once the run's onstart wrote it
        written = wait_for(lambda: (site / CONFIG).exists() and (site / CONFIG).stat().st_mtime_ns,
                           300, f"{site / CONFIG}", [proc])  # fmt: skip
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # only on a failure above: leave no workflow
            proc.wait(timeout=120)
    out = output_of(proc)
    assert rc == 0, out[-8000:]
    final = json.loads((site / "results" / "metrics" / "final.json").read_text())
    assert final["rounds"] == 2
    for r in (1, 2):
        merge = json.loads((site / "results" / "rounds" / str(r) / "merge.json").read_text())
        assert merge["status"] == "closed" and merge["report"]["contributors"] == ["lumi"]
    # the jobs ran the image's crossfed (through the stand-in), the login node the venv's
    calls = (image / "calls.log").read_text()
    for job in ("data prepare", "site run", "evaluate"):
        assert job in calls, calls
    for login in ("round wait", "run init", "probe", "plan", "report"):
        assert f" {login} " not in calls, calls
    # nothing but onstart wrote the effective config: the jobs' own parses left it alone
    assert (site / CONFIG).stat().st_mtime_ns == written

    # a dry run with another override leaves the config the running jobs read as it is
    before = (site / CONFIG).read_bytes()
    out = bash(f"{token} && {plus(dry, '--config', 'rounds=3')}", site, site_env)
    assert "This was a dry-run" in out or "Nothing to be done" in out, out[-3000:]
    assert (site / CONFIG).read_bytes() == before
    assert (site / CONFIG).stat().st_mtime_ns == written
    assert yaml.safe_load(before)["rounds"] == 2
