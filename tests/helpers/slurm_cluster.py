"""A real single-host Slurm 22.05 cluster for tests, started and stopped by the test suite.

The cluster runs Debian 12's own daemons without systemd: munged, a private MariaDB
server, slurmdbd, slurmctld and one ``slurmd -N <node>`` per node, each on a free
loopback port, with every state dir, log, socket and the database under one work
directory. Fake GPUs are gres.conf ``File=`` symlinks to ``/dev/null``.

Use it directly::

    with SlurmTestCluster(tmp_path) as cluster:
        cluster.run("sbatch", "--test-only", "-p", "lumi", "--wrap", "true")

or re-export the session fixture in a conftest.py::

    from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401

Without the packages (see scripts/install-system-deps.sh) or without root, the fixture
skips its tests with the reason, except under ``CI=true``, where it fails them.
"""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import pytest

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
CONF_MARKER = "# crossfed-test-cluster workdir="
REQUIRED_BINARIES = (
    "munged",
    "mungekey",
    "mariadb-install-db",
    "mariadbd",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sacctmgr",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
)
INSTALL_HINT = "run scripts/install-system-deps.sh as root"
_SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SACCT_", "SINFO_")
_TOKEN_VAR = "CROSSFED_SLURM_TEST_CLUSTER"
_UNIX_SOCKET_MAX = 107
_TIME_RE = re.compile(r"^(?:\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_NODE_RE = re.compile(r"^[a-z][a-z0-9]*$")


class SlurmUnavailable(RuntimeError):
    """This host cannot run the test cluster (packages missing, not root, foreign config)."""


class SlurmClusterError(RuntimeError):
    """The test cluster failed to start or to reach the state asked for; carries the logs."""


class SlurmLayoutError(ValueError):
    """A partition/node layout that the test cluster cannot express."""


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm command exited non-zero; the message includes its stdout and stderr."""

    def __str__(self) -> str:
        return (
            f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
            f"stdout: {self.stdout}\nstderr: {self.stderr}"
        )


@dataclass(frozen=True)
class PartitionSpec:
    """One partition (a "site"): its nodes, walltime cap and per-node resources."""

    nodes: tuple[str, ...]
    max_time: str
    gpus_per_node: int = 0
    gpu_type: str | None = None
    cpus_per_node: int = 2
    real_memory_mb: int = 1024
    default: bool = False

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SlurmLayoutError("a partition needs at least one node")
        for node in self.nodes:
            if not _NODE_RE.match(node):
                raise SlurmLayoutError(f"node name {node!r} must match {_NODE_RE.pattern}")
        if len(set(self.nodes)) != len(self.nodes):
            raise SlurmLayoutError(f"duplicate node in {self.nodes}")
        if not _TIME_RE.match(self.max_time):
            raise SlurmLayoutError(
                f"max_time {self.max_time!r} is not [D-]HH:MM:SS or whole minutes"
            )
        if self.gpus_per_node < 0 or self.cpus_per_node < 1 or self.real_memory_mb < 1:
            raise SlurmLayoutError(f"resources must be positive: {self}")
        if self.gpu_type is not None and not _NAME_RE.match(self.gpu_type):
            raise SlurmLayoutError(f"gpu_type {self.gpu_type!r} must match {_NAME_RE.pattern}")


DEFAULT_PARTITIONS: dict[str, PartitionSpec] = {
    "lumi": PartitionSpec(
        nodes=("n1", "n2"), max_time="00:10:00", gpus_per_node=8, gpu_type="mi250x", default=True
    ),
    "snellius": PartitionSpec(
        nodes=("n3", "n4"), max_time="00:30:00", gpus_per_node=4, gpu_type="h100"
    ),
    # CPU-only, for a workflow's small jobs (data preparation, evaluation), as real sites
    # keep them off the training partitions: a pending job of the workflow's own in a
    # training partition would push that partition's probe out by its walltime
    "small": PartitionSpec(nodes=("n5",), max_time="00:30:00"),
}


def validate_layout(partitions: Mapping[str, PartitionSpec]) -> None:
    """Raise SlurmLayoutError unless names are valid, nodes unique and one default at most."""
    if not partitions:
        raise SlurmLayoutError("at least one partition is needed")
    seen: dict[str, str] = {}
    for name, spec in partitions.items():
        if not _NAME_RE.match(name):
            raise SlurmLayoutError(f"partition name {name!r} must match {_NAME_RE.pattern}")
        for node in spec.nodes:
            if node in seen:
                raise SlurmLayoutError(f"node {node} is in both {seen[node]} and {name}")
            seen[node] = name
    if sum(spec.default for spec in partitions.values()) > 1:
        raise SlurmLayoutError("more than one partition is marked default")


@dataclass(frozen=True)
class ClusterPaths:
    """Every file and directory the cluster uses, all under ``root``."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.etc / "slurmdbd.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc / "gres.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def db_dir(self) -> Path:
        return self.root / "db"

    @property
    def db_socket(self) -> Path:
        return self.root / "run" / "mysqld.sock"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"


@dataclass(frozen=True)
class ClusterPorts:
    """Loopback TCP ports of the daemons; ``slurmd`` maps node name to port."""

    mariadb: int
    slurmdbd: int
    slurmctld: int
    slurmd: dict[str, int] = field(default_factory=dict)


def _gres(spec: PartitionSpec) -> str:
    if spec.gpus_per_node == 0:
        return ""
    kind = f"gpu:{spec.gpu_type}" if spec.gpu_type else "gpu"
    return f" Gres={kind}:{spec.gpus_per_node}"


def render_slurm_conf(
    cluster_name: str,
    partitions: Mapping[str, PartitionSpec],
    paths: ClusterPaths,
    ports: ClusterPorts,
) -> str:
    """slurm.conf text for the single-host cluster (pure)."""
    lines = [
        f"{CONF_MARKER}{paths.root}",
        f"ClusterName={cluster_name}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ports.slurmctld}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={paths.munge_socket}",
        f"StateSaveLocation={paths.spool / 'slurmctld'}",
        f"SlurmdSpoolDir={paths.spool / 'slurmd-%n'}",
        f"SlurmctldPidFile={paths.run / 'slurmctld.pid'}",
        f"SlurmdPidFile={paths.run / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={paths.log / 'slurmctld.log'}",
        f"SlurmdLogFile={paths.log / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "SlurmdParameters=config_overrides",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "GresTypes=gpu",
        "EnforcePartLimits=ALL",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/linux",
        "JobAcctGatherFrequency=30",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost",
        f"AccountingStoragePort={ports.slurmdbd}",
        f"AccountingStoragePass={paths.munge_socket}",
        "AccountingStorageEnforce=associations",
        "AccountingStorageTRES=gres/gpu",
        "InactiveLimit=0",
        "KillWait=2",
        "MinJobAge=300",
        "MessageTimeout=10",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
    ]
    for spec in partitions.values():
        for node in spec.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={ports.slurmd[node]} CPUs={spec.cpus_per_node} "
                f"RealMemory={spec.real_memory_mb}{_gres(spec)} State=UNKNOWN"
            )
    for name, spec in partitions.items():
        default = "YES" if spec.default else "NO"
        lines.append(
            f"PartitionName={name} Nodes={','.join(spec.nodes)} MaxTime={spec.max_time} "
            f"Default={default} State=UP"
        )
    return "\n".join(lines) + "\n"


def render_gres_conf(partitions: Mapping[str, PartitionSpec], paths: ClusterPaths) -> str:
    """gres.conf text: one line per GPU node, files under ``paths.dev`` (pure)."""
    lines = ["AutoDetect=off"]
    for spec in partitions.values():
        if spec.gpus_per_node == 0:
            continue
        kind = f" Type={spec.gpu_type}" if spec.gpu_type else ""
        for node in spec.nodes:
            files = paths.dev / node / f"nvidia[0-{spec.gpus_per_node - 1}]"
            lines.append(f"NodeName={node} Name=gpu{kind} File={files}")
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(paths: ClusterPaths, ports: ClusterPorts) -> str:
    """slurmdbd.conf text: accounting in the private MariaDB over loopback TCP (pure)."""
    return (
        "\n".join(
            [
                "AuthType=auth/munge",
                f"AuthInfo=socket={paths.munge_socket}",
                "DbdHost=localhost",
                f"DbdPort={ports.slurmdbd}",
                "SlurmUser=root",
                "DebugLevel=info",
                f"PidFile={paths.run / 'slurmdbd.pid'}",
                f"LogFile={paths.log / 'slurmdbd.log'}",
                "StorageType=accounting_storage/mysql",
                "StorageHost=127.0.0.1",
                f"StoragePort={ports.mariadb}",
                "StorageUser=root",
                "StorageLoc=slurm_acct_db",
            ]
        )
        + "\n"
    )


def find_binary(name: str) -> str | None:
    """Absolute path of ``name`` on PATH or in the sbin directories, else None."""
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    return shutil.which(name, path=search)


def check_available() -> dict[str, str]:
    """Paths of the binaries the cluster needs; SlurmUnavailable names what is missing."""
    found = {name: find_binary(name) for name in REQUIRED_BINARIES}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        raise SlurmUnavailable(
            f"missing {', '.join(missing)} (not on PATH or in sbin); {INSTALL_HINT}"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable("needs root: SlurmUser=root and slurmd launch jobs as root")
    return {name: path for name, path in found.items() if path is not None}


def in_ci() -> bool:
    """True when the CI environment variable says so (then unavailability is a failure)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback TCP ports that are free right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _clean_env(base: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
    path = env.get("PATH", "/usr/bin:/bin")
    extra = [d for d in _SBIN_DIRS if d not in path.split(os.pathsep)]
    env["PATH"] = os.pathsep.join([path, *extra])
    return env


def _conf_owner(text: str) -> Path | None:
    first = text.splitlines()[0] if text else ""
    return Path(first[len(CONF_MARKER) :]) if first.startswith(CONF_MARKER) else None


def _pid_alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


#: sun_path's size: a unix socket's path, with its NUL, fits in this many bytes
UNIX_PATH_MAX = 108


class SlurmTestCluster:
    """munged + MariaDB + slurmdbd + slurmctld + slurmds under one work directory."""

    def __init__(
        self,
        workdir: Path,
        partitions: Mapping[str, PartitionSpec] | None = None,
        *,
        cluster_name: str = "crossfed",
        account: str = "crossfed",
        system_conf: Path | None = SYSTEM_CONF,
        private_etc: bool = False,
    ) -> None:
        """``private_etc``: every slurmd runs in its own mount namespace in which this
        cluster's ``etc/`` is ``/etc/slurm``, as a site's nodes have their own /etc/slurm. A
        job's inner ``srun`` that runs without ``SLURM_CONF`` (the Snakemake jobstep plugin
        drops it) then still finds this cluster, so several clusters can run on one host at
        once (pass ``system_conf=None`` and distinct node names)."""
        if private_etc and system_conf is not None:
            raise SlurmLayoutError("private_etc needs system_conf=None (no shared slurm.conf)")
        self.partitions = dict(DEFAULT_PARTITIONS if partitions is None else partitions)
        validate_layout(self.partitions)
        if not _NAME_RE.match(cluster_name) or not _NAME_RE.match(account):
            raise SlurmLayoutError(f"bad cluster/account name: {cluster_name!r}/{account!r}")
        self.paths = ClusterPaths(Path(workdir).resolve())
        # a batch step's socket, spool/slurmd-<node>/<node>_<job>.<step>: a longer path
        # makes slurmstepd die at launch, and the job never starts
        longest = max(
            len(str(self.paths.spool / f"slurmd-{node}" / f"{node}_9999.4294967291"))
            for spec in self.partitions.values()
            for node in spec.nodes
        )
        if longest >= UNIX_PATH_MAX:
            raise SlurmLayoutError(
                f"work directory {self.paths.root} is too long for Slurm's unix sockets "
                f"({longest} bytes of {UNIX_PATH_MAX - 1}): use a shorter one"
            )
        self.cluster_name = cluster_name
        self.account = account
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.system_conf = system_conf
        self.private_etc = private_etc
        self.conf_path = self.paths.slurm_conf
        self.ports: ClusterPorts | None = None
        self.timings: dict[str, float] = {}
        self._token = uuid.uuid4().hex
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._bin: dict[str, str] = {}
        self._wrote_system_conf = False
        self._started = False
        self.env: dict[str, str] = {**_clean_env(os.environ), "SLURM_CONF": str(self.conf_path)}

    # ---- public API -------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        """All node names, in partition order."""
        return [node for spec in self.partitions.values() for node in spec.nodes]

    @property
    def daemon_pids(self) -> dict[str, int]:
        """Daemon name (munged, mariadbd, slurmdbd, slurmctld, slurmd-<node>) -> pid."""
        return {name: proc.pid for name, proc in self._procs}

    def start(self, timeout_s: float = 60) -> None:
        """Start every daemon and wait until all nodes are idle; stops again on failure."""
        if self._started:
            raise SlurmClusterError("cluster already started")
        self.preflight()
        deadline = time.monotonic() + timeout_s
        steps: list[tuple[str, Callable[[float], None]]] = [
            ("prepare", lambda _: self._prepare()),
            ("munged", self._start_munge),
            ("mariadbd", self._start_mariadb),
            ("slurmdbd", self._start_slurmdbd),
            ("associations", lambda _: self._add_associations()),
            ("slurmctld", self._start_slurmctld),
            ("slurmd", self._start_slurmds),
        ]
        self._started = True
        atexit.register(self.stop)  # a test that forgets stop() must not leak daemons
        try:
            for name, step in steps:
                t0 = time.monotonic()
                step(deadline)
                self.timings[name] = round(time.monotonic() - t0, 3)
        except BaseException as exc:
            logs = self.logs()
            self.stop()
            if not isinstance(exc, Exception) or isinstance(exc, SlurmClusterError):
                raise
            raise SlurmClusterError(f"Slurm test cluster failed to start: {exc}\n{logs}") from exc

    def preflight(self) -> None:
        """Raise SlurmUnavailable unless this host can run the cluster right now."""
        self._check_system_conf()
        self._bin = check_available()
        if self.private_etc:
            unshare = find_binary("unshare")
            if unshare is None:
                raise SlurmUnavailable(f"private_etc needs unshare (util-linux); {INSTALL_HINT}")
            self._bin["unshare"] = unshare

    def stop(self) -> None:
        """Cancel jobs, stop all daemons (process groups), remove runtime state; keep logs."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        if self._alive("slurmctld"):
            self._cancel_all_jobs(timeout_s=10)
        for _, proc in reversed(self._procs):
            self._terminate(proc)
        self._procs.clear()
        self._kill_strays()
        self._restore_system_conf()
        p = self.paths
        for path in (p.db_dir, p.spool, p.run, p.munge_dir, p.dev):
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> SlurmTestCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def run(
        self, *args: str, check: bool = True, timeout_s: float = 60, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command against this cluster; SlurmCommandError on failure if check.

        The default working directory is ``<workdir>/jobs``, so batch jobs without ``-o``
        leave their ``slurm-<id>.out`` there rather than in the caller's directory.
        """
        result = subprocess.run(
            list(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd or (self.paths.jobs if self.paths.jobs.is_dir() else None),
        )
        if check and result.returncode != 0:
            raise SlurmCommandError(result.returncode, list(args), result.stdout, result.stderr)
        return result

    def sbatch(self, *args: str) -> str:
        """Submit a batch job (``sbatch --parsable``); returns the job id."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def node_states(self) -> dict[str, str]:
        """Node name -> long state as sinfo prints it (idle, allocated, mixed, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Wait until the queue is empty and every node is idle."""

        def idle() -> bool:
            states = self.node_states()
            queue = self.run("squeue", "-h", "-o", "%i").stdout.strip()
            return (
                not queue
                and set(states) == set(self.nodes)
                and all(s == "idle" for s in states.values())
            )

        self._wait(idle, timeout_s, "all nodes idle and the queue empty")

    def wait_job(self, job_id: str, states: set[str], timeout_s: float = 60) -> str:
        """Wait until sacct shows ``job_id`` in one of ``states`` with a complete record.

        Complete means Partition and Timelimit are filled in: right after a job ends,
        slurmdbd can hold a row with the final State but those fields still empty for a
        few seconds. Returns the state's first word (``CANCELLED by 0`` -> ``CANCELLED``).
        """
        found: list[str] = []

        def reached() -> bool:
            cmd = ("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,Partition,Timelimit")
            row = self.run(*cmd).stdout.strip().split("|")
            state = row[0].split(" ")[0] if row[0] else ""
            found[:] = [state]
            return state in states and len(row) == 3 and all(row[1:])

        self._wait(reached, timeout_s, f"job {job_id} in {sorted(states)} in sacct")
        return found[0]

    def logs(self, tail_lines: int = 60) -> str:
        """The last lines of every daemon log, for failure messages."""
        chunks = []
        for path in sorted(self.paths.log.glob("*")) if self.paths.log.is_dir() else []:
            lines = path.read_text(errors="replace").splitlines()[-tail_lines:]
            chunks.append(f"==> {path.name} <==\n" + "\n".join(lines))
        return "\n".join(chunks) if chunks else "(no logs)"

    # ---- start-up steps ---------------------------------------------------------------

    def _check_system_conf(self) -> None:
        target = self.system_conf
        if target is None or not target.exists():
            return
        owner = _conf_owner(target.read_text(errors="replace"))
        if owner is None:
            raise SlurmUnavailable(
                f"{target} belongs to another Slurm setup; the test cluster must write its "
                "own there because a job's inner srun may run without SLURM_CONF. Move it "
                "away, or pass system_conf=None for tests that need no such srun."
            )
        if owner != self.paths.root and _pid_alive(owner / "run" / "slurmctld.pid"):
            raise SlurmUnavailable(f"{target} is in use by another live test cluster at {owner}")

    def _prepare(self) -> None:
        p = self.paths
        if len(str(p.munge_socket)) > _UNIX_SOCKET_MAX or len(str(p.db_socket)) > _UNIX_SOCKET_MAX:
            raise SlurmClusterError(f"workdir {p.root} is too long for a unix socket path")
        for path in (p.db_dir, p.spool, p.run, p.munge_dir, p.dev):
            shutil.rmtree(path, ignore_errors=True)
        for path in (p.etc, p.munge_dir, p.run, p.spool / "slurmctld", p.log, p.dev, p.jobs):
            path.mkdir(parents=True, exist_ok=True)
        p.munge_dir.chmod(0o755)
        for spec in self.partitions.values():
            for node in spec.nodes:
                (p.spool / f"slurmd-{node}").mkdir(parents=True, exist_ok=True)
                node_dev = p.dev / node
                node_dev.mkdir(parents=True, exist_ok=True)
                for index in range(spec.gpus_per_node):
                    (node_dev / f"nvidia{index}").symlink_to("/dev/null")
        names = ["mariadb", "slurmdbd", "slurmctld", *self.nodes]
        ports = free_ports(len(names))
        self.ports = ClusterPorts(
            mariadb=ports[0],
            slurmdbd=ports[1],
            slurmctld=ports[2],
            slurmd=dict(zip(self.nodes, ports[3:], strict=True)),
        )
        conf = render_slurm_conf(self.cluster_name, self.partitions, p, self.ports)
        p.slurm_conf.write_text(conf)
        p.gres_conf.write_text(render_gres_conf(self.partitions, p))
        p.slurmdbd_conf.write_text(render_slurmdbd_conf(p, self.ports))
        p.slurmdbd_conf.chmod(0o600)
        if self.system_conf is not None:
            self.system_conf.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.system_conf.with_name(f".{self.system_conf.name}.{self._token}")
            tmp.write_text(conf)
            tmp.chmod(0o644)
            tmp.replace(self.system_conf)
            self._wrote_system_conf = True

    def _start_munge(self, deadline: float) -> None:
        p = self.paths
        keygen = [self._bin["mungekey"], "--create", f"--keyfile={p.munge_key}"]
        self._check_call("mungekey", keygen)
        p.munge_key.chmod(0o400)
        self._spawn(
            "munged",
            [
                self._bin["munged"],
                "--foreground",
                "--force",
                f"--socket={p.munge_socket}",
                f"--key-file={p.munge_key}",
                f"--pid-file={p.munge_dir / 'munged.pid'}",
                f"--log-file={p.log / 'munged.log'}",
                f"--seed-file={p.munge_dir / 'munged.seed'}",
            ],
        )
        self._wait(p.munge_socket.exists, deadline - time.monotonic(), "munged socket")

    def _start_mariadb(self, deadline: float) -> None:
        p = self.paths
        self._check_call(
            "mariadb-install-db",
            [
                self._bin["mariadb-install-db"],
                "--no-defaults",
                f"--datadir={p.db_dir}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
            ],
        )
        self._spawn(
            "mariadbd",
            [
                self._bin["mariadbd"],
                "--no-defaults",
                f"--datadir={p.db_dir}",
                f"--socket={p.db_socket}",
                f"--pid-file={p.run / 'mariadbd.pid'}",
                f"--log-error={p.log / 'mariadbd.log'}",
                f"--port={self.ports.mariadb}",
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=16M",
                "--innodb-lock-wait-timeout=900",
                "--innodb-flush-log-at-trx-commit=0",
                "--innodb-doublewrite=0",
                "--innodb-flush-method=nosync",
            ],
        )

        def listening() -> bool:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                return sock.connect_ex(("127.0.0.1", self.ports.mariadb)) == 0

        self._wait(listening, deadline - time.monotonic(), "mariadbd listening")

    def _start_slurmdbd(self, deadline: float) -> None:
        self._spawn("slurmdbd", [self._bin["slurmdbd"], "-D"])

        def answers() -> bool:
            return self.run("sacctmgr", "-n", "show", "cluster", check=False).returncode == 0

        self._wait(answers, deadline - time.monotonic(), "slurmdbd answering sacctmgr")

    def _add_associations(self) -> None:
        self.run("sacctmgr", "-i", "add", "cluster", self.cluster_name)
        self.run(
            "sacctmgr",
            "-i",
            "add",
            "account",
            self.account,
            f"Cluster={self.cluster_name}",
            "Description=crossfed test account",
            "Organization=crossfed",
        )
        self.run(
            "sacctmgr",
            "-i",
            "add",
            "user",
            self.user,
            f"Account={self.account}",
            f"DefaultAccount={self.account}",
            f"Cluster={self.cluster_name}",
        )

    def _start_slurmds(self, deadline: float) -> None:
        prefix: list[str] = []
        if self.private_etc:  # this cluster's etc/ is /etc/slurm for slurmd and its jobs
            SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)  # the mount point
            mount = 'mount --bind "$0" /etc/slurm && exec "$@"'
            prefix = [self._bin["unshare"], "--mount", "--propagation", "private", "sh", "-c"]
            prefix += [mount, str(self.paths.etc)]
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [*prefix, self._bin["slurmd"], "-D", "-N", node])
        self.wait_idle(max(deadline - time.monotonic(), 1.0))

    def _start_slurmctld(self, deadline: float) -> None:
        self._spawn("slurmctld", [self._bin["slurmctld"], "-D"])

        def answers() -> bool:
            out = self.run("scontrol", "ping", check=False).stdout
            return "UP" in out

        self._wait(answers, deadline - time.monotonic(), "slurmctld answering scontrol ping")

    # ---- process handling -------------------------------------------------------------

    def _daemon_env(self) -> dict[str, str]:
        return {**self.env, _TOKEN_VAR: self._token}

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.paths.log / f"{name}.out").open("ab")
        try:
            proc = subprocess.Popen(
                argv,
                env=self._daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.paths.root,
            )
        finally:
            out.close()
        self._procs.append((name, proc))

    def _check_call(self, name: str, argv: list[str]) -> None:
        with (self.paths.log / f"{name}.out").open("ab") as out:
            rc = subprocess.run(
                argv, env=self._daemon_env(), stdout=out, stderr=subprocess.STDOUT, timeout=120
            ).returncode
        if rc != 0:
            raise SlurmClusterError(f"{name} exited {rc}\n{self.logs()}")

    def _alive(self, name: str) -> bool:
        return any(n == name and proc.poll() is None for n, proc in self._procs)

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            dead = [(n, proc.returncode) for n, proc in self._procs if proc.poll() is not None]
            if dead:
                raise SlurmClusterError(
                    f"waiting for {what}: daemon(s) exited: {dead}\n{self.logs()}"
                )
            if ready():
                return
            if time.monotonic() >= deadline:
                raise SlurmClusterError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.1)

    def _cancel_all_jobs(self, timeout_s: float) -> None:
        try:
            self.run("scancel", "--user", self.user, check=False, timeout_s=15)
            self._wait(
                lambda: not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(),
                timeout_s,
                "jobs to end",
            )
        except (SlurmClusterError, subprocess.TimeoutExpired):
            pass  # daemons are killed next; strays are swept by _kill_strays

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes]) -> None:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # the leader is gone; take down anything left in its group (e.g. forked helpers)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_strays(self) -> None:
        """SIGKILL leftover daemons/slurmstepds (our token) and job tasks (job id + our conf)."""
        token = f"\0{_TOKEN_VAR}={self._token}\0".encode()
        conf = f"\0SLURM_CONF={self.conf_path}\0".encode()
        protected = {os.getpid(), *_ancestors()}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in protected:
                continue
            try:
                environ = b"\0" + (entry / "environ").read_bytes() + b"\0"
            except OSError:
                continue
            if token in environ or (conf in environ and b"\0SLURM_JOB_ID=" in environ):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _restore_system_conf(self) -> None:
        if not self._wrote_system_conf or self.system_conf is None:
            return
        self._wrote_system_conf = False
        try:
            if _conf_owner(self.system_conf.read_text(errors="replace")) == self.paths.root:
                self.system_conf.unlink()
        except OSError:
            pass


def _ancestors() -> set[int]:
    pids: set[int] = set()
    pid = os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


# ---- captured outputs ---------------------------------------------------------------------

DATA_FILE = Path(__file__).parent / "data" / "slurm_2205_outputs.txt"
_HOLD_LUMI = ("-p", "lumi", "-N", "2", "--exclusive", "-t", "00:10:00", "--wrap", "sleep 600")
TEST_ONLY_CASES: dict[str, tuple[str, ...]] = {
    name: tuple(shlex.split(args))
    for name, args in {
        "test_only_ok_lumi": "-p lumi -N 1 --gres=gpu:8 -t 00:10:00",
        "test_only_ok_snellius_two_nodes": "-p snellius -N 2 --gres=gpu:h100:4 -t 00:30:00",
        "test_only_walltime_too_long": "-p lumi -N 1 -t 00:20:00",
        "test_only_invalid_partition": "-p nosuch -N 1 -t 00:05:00",
        "test_only_too_many_gpus": "-p lumi -N 1 --gres=gpu:9 -t 00:05:00",
        "test_only_too_many_nodes": "-p lumi -N 3 -t 00:05:00",
        "test_only_invalid_account": "-p snellius -A nosuch -t 00:05:00",
    }.items()
}
BUSY_CASES: dict[str, tuple[str, ...]] = {
    "test_only_lumi_busy": ("-p", "lumi", "-N", "1", "-t", "00:05:00"),
}
SACCT_FIELDS = "JobID,JobName,Partition,Account,State,ExitCode,Elapsed,Timelimit,NNodes,AllocTRES"


@dataclass(frozen=True)
class Capture:
    """One command run against the live cluster and what it printed."""

    name: str
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def _capture(cluster: SlurmTestCluster, name: str, argv: tuple[str, ...]) -> Capture:
    res = cluster.run(*argv, check=False)
    return Capture(name, argv, res.returncode, res.stdout, res.stderr)


def _test_only(args: tuple[str, ...]) -> tuple[str, ...]:
    return ("sbatch", "--test-only", *args, "--wrap", "true")


def capture_test_only(cluster: SlurmTestCluster) -> list[Capture]:
    """``sbatch --test-only`` on an idle cluster, then with lumi fully held by one job."""
    cluster.wait_idle(30)
    out = [_capture(cluster, name, _test_only(args)) for name, args in TEST_ONLY_CASES.items()]
    hold = cluster.sbatch(*_HOLD_LUMI)
    try:
        cluster.wait_job(hold, {"RUNNING"}, 30)
        out += [_capture(cluster, name, _test_only(args)) for name, args in BUSY_CASES.items()]
    finally:
        cluster.run("scancel", hold)
    cluster.wait_idle(30)
    return out


def capture_sacct(cluster: SlurmTestCluster) -> list[Capture]:
    """``sacct -X -P`` rows of a completed 8-GPU job and a cancelled 2-node 8-GPU job."""
    done = cluster.sbatch("-p", "lumi", "--gres=gpu:8", "-t", "00:05:00", "--wrap", "sleep 1")
    cancelled = cluster.sbatch(
        "-p", "snellius", "-N", "2", "--gres=gpu:h100:4", "-t", "00:30:00", "--wrap", "sleep 600"
    )
    cluster.wait_job(cancelled, {"RUNNING"}, 30)
    cluster.run("scancel", cancelled)
    cluster.wait_job(done, {"COMPLETED"}, 60)
    cluster.wait_job(cancelled, {"CANCELLED"}, 60)
    sacct = ("sacct", "-X", "-P", "-o", SACCT_FIELDS, "-j")
    return [
        _capture(cluster, "sacct_completed", (*sacct, done)),
        _capture(cluster, "sacct_cancelled", (*sacct, cancelled)),
    ]


_HEADER = """\
# Outputs of Slurm 22.05 (Debian 12 packages) captured from the live single-host test
# cluster in tests/helpers/slurm_cluster.py, default layout: partition lumi (MaxTime=00:10:00,
# nodes n1,n2, 8 GPUs of type mi250x each) and snellius (MaxTime=00:30:00, nodes n3,n4,
# 4 GPUs of type h100 each), CPUs=2 per node, account crossfed. test_only_lumi_busy ran
# while one job held both lumi nodes with -t 00:10:00.
# Job ids, timestamps and elapsed times change from run to run; the rest is stable.
# Regenerate: .venv/bin/python tests/helpers/slurm_cluster.py --capture
#   tests/helpers/data/slurm_2205_outputs.txt
# Format: lines starting with '#' before the first case are this header. Each case is
# '=== <name>', '$ <command>', 'rc: <exit status>', then '--- stdout' and '--- stderr',
# each followed by the stream verbatim (possibly empty, newline-terminated).
"""


def render_captures(captures: list[Capture]) -> str:
    """The data-file text for ``captures`` (pure)."""
    parts = [_HEADER]
    for cap in captures:
        parts.append(
            f"=== {cap.name}\n$ {shlex.join(cap.argv)}\nrc: {cap.returncode}\n"
            f"--- stdout\n{cap.stdout}--- stderr\n{cap.stderr}"
        )
    return "".join(parts)


def parse_captures(text: str) -> dict[str, Capture]:
    """Inverse of render_captures: case name -> Capture."""
    out: dict[str, Capture] = {}
    for block in re.split(r"^=== ", text, flags=re.M)[1:]:
        match = re.fullmatch(
            r"(?P<name>\S+)\n\$ (?P<cmd>.*)\nrc: (?P<rc>-?\d+)\n"
            r"--- stdout\n(?P<stdout>.*?)--- stderr\n(?P<stderr>.*)",
            block,
            flags=re.S,
        )
        if match is None:
            raise ValueError(f"malformed capture block: {block[:80]!r}")
        out[match["name"]] = Capture(
            match["name"],
            tuple(shlex.split(match["cmd"])),
            int(match["rc"]),
            match["stdout"],
            match["stderr"],
        )
    return out


def load_captures(path: Path = DATA_FILE) -> dict[str, Capture]:
    """The captured outputs stored in ``path`` (tests/helpers/data/slurm_2205_outputs.txt)."""
    return parse_captures(path.read_text())


def normalise(text: str) -> str:
    """Blank out what changes between runs: job ids, timestamps, durations."""
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", "<time>", text)
    text = re.sub(r"\bJob \d+", "Job <id>", text)
    return re.sub(r"^\d+\|", "<id>|", text, flags=re.M)


# ---- pytest glue --------------------------------------------------------------------------


def skip_or_fail(exc: SlurmUnavailable) -> None:
    """Skip the requesting test with the reason; fail it instead under CI=true."""
    if in_ci():
        pytest.fail(f"CI=true but the Slurm test cluster is unavailable: {exc}", pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {exc}")


def _try_start(cluster: SlurmTestCluster) -> SlurmUnavailable | None:
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        return exc
    return None


_SHARED: dict[tuple[tuple[str, PartitionSpec], ...], tuple[SlurmTestCluster, int]] = {}


def _layout_key(
    partitions: Mapping[str, PartitionSpec] | None,
) -> tuple[tuple[str, PartitionSpec], ...]:
    return tuple((DEFAULT_PARTITIONS if partitions is None else partitions).items())


def slurm_cluster_fixture(
    partitions: Mapping[str, PartitionSpec] | None = None, *, scope: str = "session"
) -> Callable[..., Iterator[SlurmTestCluster]]:
    """A pytest fixture (default scope: session) yielding a started SlurmTestCluster.

    Fixtures made for the same layout share one cluster, so a conftest re-export and a
    module-level fixture never start two. While it lives, ``os.environ["SLURM_CONF"]``
    points at the cluster. Unavailable packages skip (fail under CI=true).
    """

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def slurm_cluster(
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[SlurmTestCluster]:
        key = _layout_key(partitions)
        if key in _SHARED:
            cluster, count = _SHARED[key]
            _SHARED[key] = (cluster, count + 1)
        else:
            cluster = SlurmTestCluster(tmp_path_factory.mktemp("slurm"), partitions)
            unavailable = _try_start(cluster)
            if unavailable is not None:
                skip_or_fail(unavailable)
            _SHARED[key] = (cluster, 1)
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.conf_path)
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
            cluster, count = _SHARED[key]
            if count > 1:
                _SHARED[key] = (cluster, count - 1)
            else:
                del _SHARED[key]
                cluster.stop()

    return slurm_cluster


slurm_cluster = slurm_cluster_fixture()


def _main(argv: list[str]) -> None:
    """``[workdir]``: start, print sinfo, stop. ``--capture FILE``: regenerate the data file."""
    import tempfile

    capture_to = None
    if argv[:1] == ["--capture"] and len(argv) == 2:
        capture_to, argv = Path(argv[1]), []
    with tempfile.TemporaryDirectory(prefix="slurm-") as scratch:
        base = Path(argv[0]) if argv else Path(scratch)
        t0 = time.monotonic()
        with SlurmTestCluster(base) as live:
            print(f"started in {time.monotonic() - t0:.1f} s at {base}: {live.timings}")
            print(live.run("sinfo").stdout)
            if capture_to is not None:
                captures = capture_test_only(live) + capture_sacct(live)
                capture_to.parent.mkdir(parents=True, exist_ok=True)
                capture_to.write_text(render_captures(captures))
                print(f"wrote {len(captures)} captures to {capture_to}")


if __name__ == "__main__":
    _main(sys.argv[1:])
