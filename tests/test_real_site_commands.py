"""The README's real-site commands, run as written, against the test Slurm cluster.

A copy of the checkout stands in for a LUMI login node's clone, with the venv this test
runs from as its ``.venv`` (the README's ``python -m venv .venv && pip install -e .``). The
user's edits of the CHANGE-ME values are made the way a user makes them: the account,
partitions and memory for the test cluster's nodes, the coordinator's URL, the image, and
a tiny run (``model.device: cpu``, since the test nodes have no GPU). The commands of
"3. Each site" then run literally with a ``PATH`` of ``/usr/bin:/bin`` and the stand-in for
``apptainer`` only (tests/standins/apptainer runs the command without a container; its
"image" is a folder whose ``bin/crossfed`` records each call), so nothing can find the
venv's crossfed through ``PATH``. The coordinator of "1. The coordinator VM" runs from its
own copy of the checkout: the README's secrets command and ``run init`` as written, the
server without TLS on a loopback port.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from slurm_cluster import SlurmTestCluster, slurm_cluster  # noqa: F401 (the session fixture)

from crossfed.coordinator.embedded import free_port

REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent
STANDINS = REPO / "tests" / "standins"
BARE_PATH = f"{STANDINS}:/usr/bin:/bin"
CONFIG = Path("results/.crossfed/config.yaml")


def bash_blocks(heading: str) -> list[str]:
    """The ```bash blocks of the README section that starts at ``heading``."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n### ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def commands(block: str, prefix: str) -> list[str]:
    """The lines of ``block`` that start with ``prefix``, as written (comments and all)."""
    return [line for line in block.splitlines() if line.startswith(prefix)]


def command(block: str, words: str) -> str:
    """The one line of ``block`` that is exactly ``words`` plus, maybe, a comment."""
    (line,) = [
        line for line in block.splitlines() if re.fullmatch(rf"{re.escape(words)}\s*(#.*)?", line)
    ]
    return line


def plus(line: str, *args: str) -> str:
    """A README line with more arguments (before its comment)."""
    return " ".join([line.split("#")[0].strip(), *args])


def checkout(dest: Path) -> Path:
    """A clone-like copy of the working tree (tracked and untracked files, links kept)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if name == ".venv":  # a venv linked in (not a folder), which .gitignore's `.venv/` misses
            continue
        source, target = REPO / name, dest / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    (dest / ".venv").symlink_to(VENV)
    return dest


def edit_yaml(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def user_edits(site: Path, cluster: SlurmTestCluster, url: str, image: Path) -> None:
    """The README's "edit ..." steps, filled in for the test cluster and a tiny run."""

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
        c.update(rounds=2)
        c["data"].update(vocab_size=512, seq_len=32, block_size=4)
        c["inner"].update(steps=4, warmup_steps=1)
        c["eval"].update(max_windows=32)
        c["round_policy"].update(join_window_s=2)
        c["darl"].update(min_ttl_s=4, initial_ttl_s=8, heartbeat_s=0.5)

    edit_yaml(site / "profiles" / "lumi" / "config.yaml", profile)
    edit_yaml(site / "profiles" / "lumi" / "crossfed.yaml", overlay)
    edit_yaml(site / "profiles" / "slurm" / "sites.yaml", sites)
    edit_yaml(site / "config" / "config.yaml", run)


def stand_in_image(path: Path) -> Path:
    """The stand-in's "image": bin/crossfed records its arguments and runs crossfed."""
    (path / "bin").mkdir(parents=True)
    script = path / "bin" / "crossfed"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {path}/calls.log\n'
        f'exec {VENV / "bin" / "python"} -m crossfed "$@"\n'
    )
    script.chmod(0o755)
    return path


def bash(line: str, cwd: Path, env: dict[str, str], timeout_s: float = 900) -> str:
    """Run one README line with bash, as a user types it; its output (it must succeed)."""
    done = subprocess.run(
        ["/bin/bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, f"{line}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done.stdout + done.stderr


def test_dry_runs_find_the_profile_and_write_nothing(tmp_path: Path) -> None:
    """Every documented form of the dry run works from the root without the venv on PATH."""
    site = checkout(tmp_path / "site")
    env = {"HOME": str(tmp_path / "home"), "PATH": BARE_PATH}
    assert shutil.which("crossfed", path=BARE_PATH) is None
    assert shutil.which("snakemake", path=BARE_PATH) is None
    dry = command(bash_blocks("### 3. Each site")[0], ".venv/bin/snakemake --profile lumi -n")
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
    setup, init = bash_blocks("### 1. The coordinator VM")
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
    (each_site,) = bash_blocks("### 3. Each site")
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
    proc = subprocess.Popen(
        ["/bin/bash", "-c", f"{token} && {run}"], cwd=site, env=site_env,
        stdout=open(tmp_path / "site.out", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        written = wait_for_config(site / CONFIG, proc)
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # only on a failure above: leave no workflow
            proc.wait(timeout=120)
    out = (tmp_path / "site.out").read_text()
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


def wait_for_config(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> int:
    """The modification time of the effective config once the run's onstart wrote it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.stat().st_mtime_ns
        if proc.poll() is not None:
            raise AssertionError("the workflow ended before writing its config")
        time.sleep(0.2)
    raise AssertionError(f"no {path} after {timeout_s} s")
