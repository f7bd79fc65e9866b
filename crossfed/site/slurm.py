"""What a site job knows of Slurm: its allocation, its nodes, and how its ranks start there.

The pure parts parse ``squeue`` text; ``slurm_allocation`` and ``srun_per_node`` are the only
functions that call Slurm's tools or read its environment. ``planned_job`` turns a plan into
the shape of a site's next chain job (partition, nodes, GPUs, walltime).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from crossfed.site.loop import ChainError

if TYPE_CHECKING:
    from crossfed.config import LauncherSection

_UNSET_TIMES = {"", "N/A", "NONE", "UNKNOWN", "UNLIMITED", "INVALID"}


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its id, nodes and when it ends."""

    job_id: str
    nodes: tuple[str, ...]
    end: float | None  # epoch seconds; None when Slurm reports no limit

    @property
    def head(self) -> str:
        """The first node: torchrun's rendezvous host."""
        return self.nodes[0]


def parse_end_time(text: str) -> float | None:
    """Epoch seconds of an ``squeue -o %e`` end time (the cluster's local time), or None."""
    value = text.strip()
    if value.upper() in _UNSET_TIMES:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise ChainError(f"squeue end time is not an ISO timestamp: {value!r}") from exc


def parse_squeue_job(text: str) -> tuple[float | None, str]:
    """``squeue -h -j ID -o %e|%N`` output -> (end time, compressed node list)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or "|" not in lines[0]:
        raise ChainError(f"unexpected squeue output: {text.strip()[:200]!r}")
    end, nodelist = lines[0].split("|", 1)
    return parse_end_time(end), nodelist.strip()


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    """Run a Slurm client command with standard (ISO) times, whatever the user's format."""
    from crossfed.sched.sacct import slurm_client_env

    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=60, env=slurm_client_env()
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ChainError(f"{cmd[0]} failed: {exc}") from exc
    if proc.returncode != 0:
        raise ChainError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[:300]}")
    return proc.stdout


def slurm_allocation(env: Mapping[str, str] | None = None, run: Runner = _run) -> Allocation | None:
    """The allocation named by ``SLURM_JOB_ID``, asked of squeue; None outside Slurm.

    Snakemake's Slurm job step strips most ``SLURM_*`` variables before it runs a rule, so
    the node list and end time come from squeue and scontrol, not from the environment.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    end, nodelist = parse_squeue_job(run(["squeue", "-h", "-j", job_id, "-o", "%e|%N"]))
    nodes = tuple(run(["scontrol", "show", "hostnames", nodelist]).split()) if nodelist else ()
    if not nodes:
        raise ChainError(f"squeue shows no nodes for running job {job_id}")
    return Allocation(job_id, nodes, end)


def srun_per_node(alloc: Allocation) -> list[str]:
    """``srun`` that starts one task on every node of the allocation (one torchrun each).

    Used in the batch step itself: the rule is submitted with Snakemake's ``mpi`` resource,
    so the job step runs it without wrapping it in its own single-task ``srun`` (a step
    inside that step would find the node's CPUs taken).
    """
    n = len(alloc.nodes)
    return [
        "srun",
        f"--jobid={alloc.job_id}",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]


def parse_node_address(text: str, node: str) -> str:
    """NodeAddr from ``scontrol show node`` output (the node name when none is given)."""
    match = re.search(r"\bNodeAddr=(\S+)", text)
    return match.group(1) if match else node


def node_address(node: str, run: Runner = _run) -> str:
    """How other nodes reach ``node`` (its NodeAddr: node names need not resolve)."""
    return parse_node_address(run(["scontrol", "show", "node", node]), node)


def rendezvous_endpoint(address: str, port: int = 29400) -> str:
    """torchrun's c10d rendezvous at the allocation's head node."""
    return f"{address}:{port}"


def relaunch_ranks(ranks: int, argv: Sequence[str], launcher: LauncherSection) -> int:
    """Run ``crossfed <argv>`` again as ``ranks`` torchrun processes; their exit code.

    Inside a Slurm allocation of several nodes, ``srun`` starts one torchrun per node and
    they meet at the head node; otherwise torchrun runs here as the launcher config says.
    """
    from crossfed.train.distributed import (
        DistributedError,
        python_torchrun,
        relaunch_under_torchrun,
        torchrun_argv,
    )

    alloc = slurm_allocation()
    if alloc is None or len(alloc.nodes) == 1:
        return relaunch_under_torchrun(ranks, argv, launcher)
    nodes = len(alloc.nodes)
    if ranks % nodes:
        raise DistributedError(f"{ranks} ranks do not spread evenly over {nodes} nodes")
    cmd = srun_per_node(alloc) + torchrun_argv(
        ranks // nodes,
        argv,
        torchrun=launcher.command or python_torchrun(),
        nnodes=nodes,
        rdzv_endpoint=rendezvous_endpoint(node_address(alloc.head)),
    )
    return subprocess.call(cmd)


def planned_job(plan: Mapping[str, Any] | None, site: str, site_cfg: Mapping[str, Any]) -> dict:
    """Shape of a site's next chain job from a plan (or its first shape when unplanned).

    The job asks for the shape's full walltime (capped by the site's maximum): a chain job
    trains as many rounds as fit, so a longer allocation only means fewer queue waits.
    """
    from crossfed.config import SlurmDurationError, parse_slurm_duration

    entry = (plan or {}).get("sites", {}).get(site, {}) or {}
    shapes = list(site_cfg.get("shapes") or [])
    if not shapes:
        raise ChainError(f"site {site!r} has no job shapes; a Slurm site needs at least one")
    shape = next((s for s in shapes if s["name"] == entry.get("shape")), shapes[0])
    try:
        wall = parse_slurm_duration(shape["walltime"])
    except SlurmDurationError as exc:
        raise ChainError(f"site {site!r} shape {shape['name']!r}: {exc}") from exc
    cap = float(site_cfg.get("max_walltime_h") or math.inf) * 3600.0
    wall = min(wall or cap, cap)
    if not math.isfinite(wall) or wall <= 0:
        raise ChainError(f"site {site!r} shape {shape['name']!r}: no finite walltime")
    nodes, per_node = int(shape["nodes"]), int(shape.get("gpus_per_node", 0))
    return {
        "shape": shape["name"],
        "partition": shape["partition"],
        "nodes": nodes,
        "gpus_per_node": per_node,
        "gpus": nodes * per_node,
        "walltime_s": wall,
        "runtime_min": max(1, math.ceil(wall / 60.0 - 1e-9)),
        "submit": entry.get("submit", True) is not False,
        "accumulation": entry.get("accumulation"),
    }
