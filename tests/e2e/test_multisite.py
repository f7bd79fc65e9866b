"""The run as sites really run it: one coordinator, separate sites with their own everything.

A coordinator VM (its own copy of the checkout) serves over TLS with a CA made here; the
secrets come from docs/real-site.md's ``crossfed coordinator secrets`` and the run from its
``run init``, with the admin token. Two sites, lumi and snellius, each have their own
copy of the checkout and working directory, only their own token, their own home, their
own copy of the CA (trusted through ``SSL_CERT_FILE``), their own Snakemake started with
the page's command and their own profile (``here: [<site>]``), and each submits to its
own Slurm 22.05 cluster: two clusters on this host with their own munged, MariaDB,
slurmdbd, slurmctld, ports, state and node names. Each site's login-node commands find
their cluster through ``SLURM_CONF``; each cluster's slurmds (and so its jobs, whose inner
``srun`` runs without ``SLURM_CONF``) see that cluster's ``/etc/slurm`` in their own mount
namespace, as a site's nodes have their own (``SlurmTestCluster(..., system_conf=None,
private_etc=True)``). Nothing is shared between the sites but the coordinator's URL.

lumi starts first (it prepares the data the VM creates the run from, as the page says);
snellius starts while lumi trains round 1, prepares its own data and joins rounds late, at
the coordinator's current round. lumi's training job is cancelled by its Slurm
(``scancel``) mid-round and submitted again; later snellius's workflow is interrupted
(Ctrl-C) while lumi keeps training, and resumed.
At the end the ledger is exact, both sites hold every round's global model (byte for byte
the coordinator's) and a report that describes the whole run alike, no file of one site
names the other's folder or token, and ``crossfed export`` gives the same model at both.

The stand-ins, named as such: ``tests/helpers/standins/apptainer`` (lumi's jobs run the image's
crossfed without a container; the image is a folder) and ``tests/helpers/standins/module``
(snellius's env-modules jobs load nothing). The test nodes have no GPU (``model.device:
cpu``; the clusters' GPUs are gres files), and ``min_step_s`` paces the simulated steps.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from crossfed.client.http import CoordinatorClient, Refused
from crossfed.coordinator.embedded import free_port
from crossfed.darl.ledger import COMMITTED_TABLE
from tests.helpers import workflow
from tests.helpers.slurm_cluster import (
    PartitionSpec,
    SlurmTestCluster,
    SlurmUnavailable,
    skip_or_fail,
)
from tests.helpers.workflow import (
    BARE_PATH,
    REAL_SITE,
    VENV,
    background,
    bash,
    bash_blocks,
    catches_sigint,
    checkout,
    command,
    commands,
    edit_yaml,
    output_of,
    small_run,
    stand_in_image,
    submitting,
)

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CROSSFED_MULTISITE") != "1",
        reason="10-20 minutes, over CI's budget: run bench/multisite.py (CROSSFED_MULTISITE=1)",
    ),
]
#: waits here poll the test clusters' queues and the coordinator: twice a second
wait_for = functools.partial(workflow.wait_for, poll_s=0.5)
ROUNDS = 12
SITES = ("lumi", "snellius")
# per site: its cluster's training and evaluation partitions (one node each, one fake GPU)
LAYOUT = {
    "lumi": {"train": ("lumi", "lumig1"), "eval": ("smallg", "lumig2")},
    "snellius": {"train": ("gpuh100", "snelg1"), "eval": ("gpuh100q", "snelg2")},
}


# ---------------------------------------------------------------------- the parts


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for localhost/127.0.0.1 signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crossfed test CA")])
    usage = dict(content_commitment=False, key_encipherment=False, data_encipherment=False,
                 key_agreement=False, encipher_only=False, decipher_only=False)  # fmt: skip
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, **usage),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "fullchain.pem", folder / "privkey.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    paths[2].chmod(0o600)
    return paths


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SlurmTestCluster]]:
    """Two Slurm clusters on this host, one per site, each with its own daemons."""
    started: dict[str, SlurmTestCluster] = {}
    try:
        for site in SITES:
            (train, train_node), (evaluation, eval_node) = LAYOUT[site].values()
            partitions = {
                train: PartitionSpec(
                    nodes=(train_node,), max_time="00:30:00", gpus_per_node=1, default=True
                ),  # fmt: skip
                evaluation: PartitionSpec(
                    nodes=(eval_node,), max_time="00:30:00", gpus_per_node=1
                ),  # fmt: skip
            }
            cluster = SlurmTestCluster(
                tmp_path_factory.mktemp(f"slurm-{site}"), partitions, cluster_name=site,
                system_conf=None,
                private_etc=True,
            )  # fmt: skip
            try:
                cluster.start()
            except SlurmUnavailable as exc:
                skip_or_fail(exc)
            started[site] = cluster
        yield started
    finally:
        for cluster in started.values():
            cluster.stop()


def site_edits(site: str, root: Path, cluster: SlurmTestCluster, url: str, image: Path) -> None:
    """The page's "edit ..." steps at one site, filled in for its cluster and a tiny run."""
    (train, _), (evaluation, _) = LAYOUT[site].values()

    def profile(p: dict) -> None:
        p["default-resources"].update(
            slurm_account=cluster.account, slurm_partition=evaluation, mem_mb=400,
            cpus_per_task=1,
        )  # fmt: skip
        p["set-resources"]["prepare_data"].update(
            slurm_partition=evaluation, cpus_per_task=1, mem_mb=400, runtime=10
        )
        p["set-resources"]["train_job"].update(cpus_per_task=1, mem_mb=400)
        p["set-threads"] = {"train_job": 1, "evaluate": 1}
        p.update({"latency-wait": 5, "slurm-init-seconds-before-status-checks": 1,
                  "seconds-between-status-checks": 1})  # fmt: skip

    def overlay(c: dict) -> None:
        c["model"]["device"] = "cpu"  # no GPU on the test nodes
        c["coordinator"]["url"] = url
        c["chain"] = {"margin_s": 15, "round_prior_s": 10}
        if site == "lumi":
            c["software"]["container"] = str(image)

    edit_yaml(root / "profiles" / site / "config.yaml", profile)
    edit_yaml(root / "profiles" / site / "crossfed.yaml", overlay)
    run_edits(root, cluster.account)


def run_edits(root: Path, account: str) -> None:
    """The run's settings, the same at every site and the VM (config and sites file)."""

    def sites(s: dict) -> None:
        run_sites = {}
        for name, pace in (("lumi", 8.0), ("snellius", 4.0)):
            entry = s["sites"][name]
            (train, _) = LAYOUT[name]["train"]
            entry.update(account=account, ranks=1, micro_batch=4, rtt_ms=0, max_walltime_h=0.5,
                         tokens_per_s_per_gpu=1000, min_step_s=pace)  # fmt: skip
            entry["shapes"] = [{"name": "g1-20m", "partition": train, "nodes": 1,
                                "gpus_per_node": 1, "walltime": "00:20:00"}]  # fmt: skip
            run_sites[name] = entry
        s["sites"] = run_sites

    def run(c: dict) -> None:
        small_run(c, ROUNDS, steps=4, max_windows=32, join_window_s=2)

    edit_yaml(root / "profiles" / "slurm" / "sites.yaml", sites)
    edit_yaml(root / "config" / "config.yaml", run)


class Site:
    """One site: its clone, its cluster, its environment and its documented commands."""

    def __init__(self, name: str, root: Path, cluster: SlurmTestCluster, token: str) -> None:
        self.name, self.root, self.cluster, self.token = name, root, cluster, token
        self.results = root / "results"
        each_site = bash_blocks("## 3. Each site", REAL_SITE)[0]
        (export,) = commands(each_site, "export CROSSFED_TOKEN=")
        self.export = export.replace("<this site's token>", token)
        self.run_line = command(each_site, ".venv/bin/snakemake --profile lumi").replace(
            "lumi", name
        )
        shutil.copy2(root.parent / "vm" / "tls" / "ca.pem", root / "ca.pem")  # its own copy
        self.env = {
            "HOME": str(root / "home"),
            "PATH": BARE_PATH,
            "SLURM_CONF": cluster.env["SLURM_CONF"],
            "SSL_CERT_FILE": str(root / "ca.pem"),
            "PYTHONUNBUFFERED": "1",
            "MODULE_STANDIN_LOG": str(root / "modules.log"),
        }
        self.runs = 0

    def sh(self, line: str, timeout_s: float = 900) -> str:
        return bash(f"{self.export} && {line}", self.root, self.env, timeout_s)

    def start(self) -> subprocess.Popen:
        """The page's `snakemake --profile <site>` in the background, Ctrl-C-able."""
        self.runs += 1
        return background(["/bin/bash", "-c", f"{self.export} && {self.run_line}"], self.root,
                          self.env, self.root / f"snakemake-{self.runs}.out")  # fmt: skip


def stop(proc: subprocess.Popen | None) -> None:
    """Only on a failure: leave no workflow behind (its jobs are cancelled with it)."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # Snakemake cancels its Slurm jobs
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def snakemake_pid(proc: subprocess.Popen) -> int:
    """The Snakemake process under the documented command's bash."""
    import psutil

    for child in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        if any(part.endswith("snakemake") for part in child.cmdline()[:2]):
            return child.pid
    raise AssertionError("no snakemake process under the site's command")


def queued(cluster: SlurmTestCluster, rule: str = "") -> list[str]:
    out = cluster.run("squeue", "-h", "-o", "%i|%k").stdout
    return [line.split("|")[0] for line in out.splitlines() if rule in line]


def closed(admin: CoordinatorClient, round_no: int) -> dict | None:
    """The coordinator's record of ``round_no`` once it has closed (not yet opened: None)."""
    try:
        info = admin.round_info(round_no) if round_no <= ROUNDS else None
    except Refused as exc:
        if exc.code != "unknown_round":
            raise
        return None
    return info if info and info["status"] == "closed" else None


def has_lease(admin: CoordinatorClient, site: str) -> bool:
    return any(lease["site"] == site for lease in admin.status()["active_leases"])


def text_files(root: Path) -> Iterator[Path]:
    """The files a site wrote that hold text: configs, records, logs (not weights)."""
    for path in [*root.glob("results/**/*"), *root.glob(".snakemake/slurm_logs/**/*"),
                 *root.glob("snakemake-*.out"), *root.glob("home/**/*")]:  # fmt: skip
        if path.is_file() and path.suffix not in {".safetensors", ".npy", ".bin", ".png",
                                                   ".distcp", ".sqlite", ".lock"}:  # fmt: skip
            yield path


# ---------------------------------------------------------------------- the run


def test_separate_sites_train_one_model(
    tmp_path: Path, clusters: dict[str, SlurmTestCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    lumi_cluster, snellius_cluster = clusters["lumi"], clusters["snellius"]
    # two clusters, each with only its own nodes
    assert set(lumi_cluster.node_states()) == {"lumig1", "lumig2"}
    assert set(snellius_cluster.node_states()) == {"snelg1", "snelg2"}

    # 1. the coordinator VM: the page's secrets command, serve with TLS as written
    vm = checkout(tmp_path / "vm")
    ca, cert, key = make_tls(vm / "tls")
    vm_env = {"HOME": str(vm / "home"), "PATH": f"{VENV / 'bin'}:/usr/bin:/bin",
              "SSL_CERT_FILE": str(ca)}  # fmt: skip
    setup, init = bash_blocks("## 1. The coordinator VM", REAL_SITE)
    (make_secrets,) = [
        line for line in setup.splitlines() if line.startswith("crossfed coordinator secrets ")
    ]
    bash(make_secrets, vm, vm_env)
    secrets = yaml.safe_load((vm / "secrets.yaml").read_text())
    serve = re.search(r"^crossfed coordinator serve .*?[^\\]\n", setup, flags=re.S | re.M)
    assert serve, setup
    port = free_port("127.0.0.1")
    url = f"https://localhost:{port}"
    serve_line = (
        serve.group(0)
        .replace("--host 0.0.0.0", "--host 127.0.0.1")
        .replace("--port 443", f"--port {port}")
        .replace("/etc/letsencrypt/live/crossfed.example.org/fullchain.pem", str(cert))
        .replace("/etc/letsencrypt/live/crossfed.example.org/privkey.pem", str(key))
    )
    assert str(cert) in serve_line and str(key) in serve_line, serve_line
    server = subprocess.Popen(
        ["/bin/bash", "-c", serve_line], cwd=vm, env=vm_env, start_new_session=True,
        stdout=open(tmp_path / "serve.out", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    procs: dict[str, subprocess.Popen | None] = {"lumi": None, "snellius": None}
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the operator's view, over TLS
        admin = CoordinatorClient(url, secrets["admin"])
        wait_for(lambda: _health(admin), 60, "the coordinator over TLS", [server])
        run_sites(tmp_path, vm, vm_env, init, url, secrets, clusters, admin, procs, timings, t0)
    finally:
        for proc in procs.values():
            stop(proc)
        os.killpg(server.pid, signal.SIGTERM)  # bash and the coordinator under it
        server.wait(timeout=60)
    timings["total_s"] = time.monotonic() - t0
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}))


def _health(admin: CoordinatorClient) -> bool:
    try:
        return admin.health().get("ok", True) is not False
    except Exception:
        return False


def run_sites(tmp_path, vm, vm_env, init, url, secrets, clusters, admin, procs, timings, t0):
    sites: dict[str, Site] = {}
    for name in SITES:
        root = checkout(tmp_path / name)
        image = stand_in_image(tmp_path / name / "crossfed-rocm.sif")
        site_edits(name, root, clusters[name], url, image)
        sites[name] = Site(name, root, clusters[name], secrets["sites"][name])
    lumi, snellius = sites["lumi"], sites["snellius"]
    run_edits(vm, clusters["lumi"].account)  # the VM has the run's files too, the same ones
    for name in ("config/config.yaml", "profiles/slurm/sites.yaml"):
        assert (vm / name).read_bytes() == (lumi.root / name).read_bytes()
        assert (snellius.root / name).read_bytes() == (lumi.root / name).read_bytes()

    # the first site prepares the data (a job on its cluster); the VM creates the run from it
    lumi.sh(command(init, ".venv/bin/snakemake --profile lumi results/data/meta.json"))
    (vm / "results" / "data").mkdir(parents=True)
    shutil.copy2(lumi.results / "data" / "meta.json", vm / "results" / "data")
    lines = init.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("CROSSFED_TOKEN="))
    run_init = "\n".join(lines[first:]).replace("<admin token>", secrets["admin"])
    assert "run created" in bash(run_init.replace("https://crossfed.example.org", url), vm, vm_env)
    timings["run_created_s"] = time.monotonic() - t0

    # 2. lumi starts; snellius starts once lumi trains round 1 (its own data job first)
    procs["lumi"] = lumi.start()
    wait_for(lambda: has_lease(admin, "lumi"), 600, "lumi training round 1", [procs["lumi"]])
    procs["snellius"] = snellius.start()
    timings["snellius_started_s"] = time.monotonic() - t0
    timings["snellius_started_at_round"] = admin.status()["round"]
    running = [procs["lumi"], procs["snellius"]]

    # 3. lumi's training job is cancelled by its Slurm mid-round (round 2 or later): the
    # lease's blocks go back on its TTL and Snakemake submits the job again
    wait_for(lambda: admin.status()["round"] >= 2 and has_lease(admin, "lumi"), 600,
             "lumi mid-round", running)  # fmt: skip
    (victim,) = queued(lumi.cluster, "rule_train_job_wildcards_lumi")
    cancelled_in = admin.status()["round"]
    lumi.cluster.run("scancel", victim)
    assert lumi.cluster.wait_job(victim, {"CANCELLED"}, 60) == "CANCELLED"
    timings["scancel_s"] = time.monotonic() - t0

    # snellius joined late, and its first chain job trained the coordinator's current round,
    # not the rounds closed before it started
    joined = wait_for(lambda: _first_contribution(admin, "snellius"), 900, "snellius", running)
    records = [int(p.parent.parent.name)
               for p in snellius.results.glob("rounds/*/train/snellius.json")]  # fmt: skip
    assert joined > 1 and min(records) > 1, (joined, records)
    assert joined <= min(records) + 1, (joined, records)
    timings["snellius_joined_s"] = time.monotonic() - t0
    timings["snellius_first_round"] = joined
    back = wait_for(lambda: _contribution_after(admin, "lumi", cancelled_in - 1), 900,
                    "lumi after the scancel", running)  # fmt: skip
    timings["lumi_back_s"] = time.monotonic() - t0

    # 4. snellius's workflow is interrupted (Ctrl-C) while lumi keeps training, then resumed
    wait_for(lambda: has_lease(admin, "snellius") and not submitting(procs["snellius"].pid), 600,
             "snellius mid-round", running)  # fmt: skip
    assert catches_sigint(snakemake_pid(procs["snellius"]))
    interrupted_in = admin.status()["round"]
    os.killpg(procs["snellius"].pid, signal.SIGINT)
    assert procs["snellius"].wait(timeout=180) != 0, output_of(procs["snellius"])[-4000:]
    wait_for(lambda: not queued(snellius.cluster), 60, "snellius's jobs cancelled")
    alone = wait_for(lambda: closed(admin, interrupted_in + 1), 600, "a round without snellius",
                     [procs["lumi"]])  # fmt: skip
    assert alone["report"]["contributors"] == ["lumi"], alone["report"]
    assert interrupted_in + 1 < ROUNDS, "the run ended before snellius could resume"
    timings["interrupted_s"] = time.monotonic() - t0
    procs["snellius"] = snellius.start()
    timings["snellius_resumed_s"] = time.monotonic() - t0
    for name in SITES:
        assert procs[name].wait(timeout=1200) == 0, output_of(procs[name])[-8000:]
    timings["finished_s"] = time.monotonic() - t0

    check_run(admin, vm, lumi, snellius, back, interrupted_in)
    timings["checked_s"] = time.monotonic() - t0


def _first_contribution(admin: CoordinatorClient, site: str) -> int | None:
    return _contribution_after(admin, site, 0)


def _contribution_after(admin: CoordinatorClient, site: str, after: int) -> int | None:
    """The first round after ``after`` whose merge took a delta of ``site``."""
    current = admin.status()["round"]
    for r in range(after + 1, min(current, ROUNDS + 1)):
        info = admin.round_info(r)
        if info["status"] == "closed" and site in info["report"]["contributors"]:
            return r
    return None


# ---------------------------------------------------------------------- the checks


def check_run(admin, vm, lumi: Site, snellius: Site, lumi_back: int, interrupted_in: int) -> None:
    reports = {r: admin.round_info(r)["report"] for r in range(1, ROUNDS + 1)}
    contributed = {s: sum(s in rep["contributors"] for rep in reports.values()) for s in SITES}
    assert all(contributed.values()), contributed
    # snellius came back after the interrupt
    assert any(
        "snellius" in reports[r]["contributors"] for r in range(interrupted_in + 2, ROUNDS + 1)
    ), reports
    assert lumi_back > 0

    # the ledger is exact: Table 3's identities, every block committed once per epoch
    ledger = pd.DataFrame(admin.ledger())
    per_site, total = ledger[ledger["site"] != "total"], ledger[ledger["site"] == "total"].iloc[0]
    for column in ("grants", "blocks_granted", "blocks_committed", "blocks_lost", "ttl_expiries"):
        assert per_site[column].sum() == total[column], column
    with sqlite3.connect(vm / "state" / "state.sqlite") as conn:
        rows = conn.execute(f"SELECT epoch, block FROM {COMMITTED_TABLE}").fetchall()
    assert len(rows) == len(set(rows)) == total["blocks_committed"] > 0
    # the cancelled lumi job lost its in-flight lease (its blocks went back on TTL)
    assert ledger.set_index("site").loc["lumi", "ttl_expiries"] >= 1

    finals = {}
    for site in (lumi, snellius):
        res = site.results
        for r in range(1, ROUNDS + 1):  # every round's record and model, as the coordinator has
            info = json.loads((res / "rounds" / str(r) / "merge.json").read_text())
            assert info["status"] == "closed" and info["report"] == reports[r], (site.name, r)
            assert (res / "rounds" / str(r) / "eval.json").exists(), (site.name, r)
        for r in range(0, ROUNDS + 1):
            model = res / "checkpoints" / f"global-{r}.safetensors"
            assert model.read_bytes() == (lumi.results / model.relative_to(res)).read_bytes()
        finals[site.name] = json.loads((res / "metrics" / "final.json").read_text())
        assert finals[site.name]["rounds"] == ROUNDS
        # the whole run, from the coordinator: every site's contributions, not only its own
        assert finals[site.name]["contributions"] == contributed, (site.name, finals)
        kept = pd.read_csv(res / "ledger.csv").set_index("site")
        assert kept.loc["total", "blocks_committed"] == total["blocks_committed"], site.name
    shared = ["round", "generation", "contributors", "tokens", "global_step", "round_s",
              "compute_s", "merge_s", "opened_at", "closed_at"]  # fmt: skip
    tables = [pd.read_csv(s.results / "metrics" / "rounds.csv")[shared] for s in (lumi, snellius)]
    pd.testing.assert_frame_equal(*tables)
    # (wall_s leaves out the time the site's own workflow was stopped: snellius's differs)
    for key in ("tokens", "global_step", "blocks_committed", "compute_s"):
        assert finals["lumi"][key] == finals["snellius"][key], key

    # each site's own Slurm ran its jobs: the chain jobs' ids are in its own cluster's sacct
    for site in (lumi, snellius):
        for path in site.results.glob(f"sites/{site.name}/job-*/outcome.json"):
            job = str(json.loads(path.read_text())["slurm_job_id"])
            part = site.cluster.run("sacct", "-X", "-n", "-P", "-j", job, "-o", "Partition")
            assert part.stdout.strip() == LAYOUT[site.name]["train"][0], (site.name, job)
    assert "load" in (snellius.root / "modules.log").read_text()  # env-modules jobs (stand-in)
    assert "site run" in (lumi.root / "crossfed-rocm.sif" / "calls.log").read_text()

    # neither site needed the other's files: no path or token of one appears at the other
    for site, other in ((lumi, snellius), (snellius, lumi)):
        config = yaml.safe_load((site.results / ".crossfed" / "config.yaml").read_text())
        assert config["here"] == [site.name]
        for path in text_files(site.root):
            text = path.read_text(errors="replace")
            assert str(other.root) not in text and other.token not in text, path

    # each site's report builds
    for site in (lumi, snellius):
        site.sh(f".venv/bin/snakemake --profile {site.name} --report report.zip")
        names = zipfile.ZipFile(site.root / "report.zip").namelist()
        for plot in ("perplexity.png", "perplexity_wallclock.png", "round_time.png"):
            assert any(n.endswith(plot) for n in names), (site.name, names)

    # the final model is the same whichever site exports it
    exported = {}
    for site in (lumi, snellius):
        site.sh(".venv/bin/crossfed export --out export")
        exported[site.name] = load_file(str(site.root / "export" / "model.safetensors"))
    assert exported["lumi"].keys() == exported["snellius"].keys()
    for name, tensor in exported["lumi"].items():
        assert torch.equal(tensor, exported["snellius"][name]), name
