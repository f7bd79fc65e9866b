"""The ranks of one site: torchrun process groups, torchtitan's FSDP2 parallelisation, gathers.

A site trains either in one process that simulates its W ranks (``launcher: simulate``, the
local default) or as W torchrun processes (``launcher: torchrun``), where rank 0 talks to the
coordinator and broadcasts what it learns. Parallelisation is torchtitan's
``parallelize_qwen3``: FSDP2 over all ranks of the site, bf16 parameters with fp32 gradient
reduction on GPU, fp32 on CPU (gloo), plus optional activation checkpointing and
``torch.compile`` per transformer block. Gradients are *summed* over ranks (the inner phase
weights each micro-batch by its share of the step), so FSDP's own division is switched off.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from crossfed.launchenv import under_torchrun
from crossfed.train.model import matching_parameters, parameters_of

if TYPE_CHECKING:
    from crossfed.config import LauncherSection

LAUNCHERS = ("simulate", "torchrun")
AC_MODES = ("none", "full", "selective")


class DistributedError(RuntimeError):
    """A launcher, rank layout or parallelisation setting that cannot work."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the site: ``world`` processes, this one is ``rank``."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


@dataclass(frozen=True)
class ParallelConfig:
    """Training techniques applied on top of FSDP2 (torchtitan's options)."""

    compile: bool = False
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in AC_MODES:
            raise DistributedError(
                f"activation_checkpointing must be one of {AC_MODES}, "
                f"got {self.activation_checkpointing!r}"
            )


#: a gloo group over all ranks for small control messages (the per-step window limit, round
#: decisions): they travel between the hosts and never wait for the device, so a rank's host
#: can queue its next step while the GPU still runs the last one
_control_group: Any = None
#: a gloo group over all ranks for checkpoints written in the background
#: (``checkpoint.save_in_background``): their collectives run on DCP's thread beside the
#: training's, so they get a group of their own
_checkpoint_group: Any = None


def init_ranks(device: str) -> Ranks:
    """Join torchrun's process group (NCCL/RCCL on GPU, gloo on CPU) and a gloo control
    group beside it; one process: no groups."""
    global _control_group, _checkpoint_group
    if not under_torchrun():
        return Ranks()
    world = int(os.environ["WORLD_SIZE"])
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    if world > 1 and _control_group is None:
        _control_group = dist.new_group(backend="gloo")
        _checkpoint_group = dist.new_group(backend="gloo")
    return Ranks(world=world, rank=rank, local_rank=local)


def close_ranks(ranks: Ranks) -> None:
    global _control_group, _checkpoint_group
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()
    _control_group = _checkpoint_group = None


def checkpoint_group() -> Any:
    """The process group of background checkpoints (None in one process)."""
    return _checkpoint_group


def resolve_device(device: str, what: str) -> str:
    """``auto`` is ``cuda`` when torch sees a GPU (ROCm builds too), else ``cpu``; asking for
    ``cuda`` where there is none is an error that names the setting."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DistributedError(f"{what} is {device!r} but torch sees no GPU here")
    return device


def rank_device(device: str, ranks: Ranks) -> str:
    """``cuda`` becomes ``cuda:<local rank>``; other devices are taken as given."""
    if device == "cuda":
        return f"cuda:{ranks.local_rank}"
    return device


def broadcast_object(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's ``obj`` on every rank (identity in one process)."""
    if not ranks.distributed:
        return obj
    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


def broadcast_int(value: int, ranks: Ranks) -> int:
    """Rank 0's integer on every rank: one small host-side collective (used once per step;
    over the control group it never waits for the device)."""
    if not ranks.distributed:
        return value
    t = torch.tensor([value if ranks.main else 0], dtype=torch.int64)
    dist.broadcast(t, src=0, group=_control_group)
    return int(t.item())


def sum_over_ranks(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Sum of ``value`` over ranks, queued on the value's device without waiting for it."""
    if not ranks.distributed:
        return value
    total = value.clone()
    dist.all_reduce(total)
    return total


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


@contextlib.contextmanager
def _mesh_device(device_type: str) -> Iterator[None]:
    """torchtitan picks the mesh device from the accelerator it finds ("cuda" when none);
    on CPU the same ParallelDims must build a gloo mesh, so point it at "cpu" meanwhile."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    saved = parallel_dims.device_type
    parallel_dims.device_type = device_type
    try:
        yield
    finally:
        parallel_dims.device_type = saved


def parallelize(
    model: torch.nn.Module, ranks: Ranks, config: ParallelConfig, device: str
) -> torch.nn.Module:
    """Apply torchtitan's ``parallelize_qwen3``: FSDP2 over the site's ranks, AC, compile.

    In one process FSDP is skipped (``skip_dp``) but activation checkpointing and compile
    still apply, so both launchers train the same program.
    """
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.models.qwen3 import parallelize_qwen3

    device_type = device.split(":")[0]
    gpu = device_type == "cuda"
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[
        config.activation_checkpointing
    ]
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=ranks.world,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=ranks.world,
        spmd_backend="partial_dtensor",
    )
    with _mesh_device(device_type):
        if ranks.distributed:
            dims.build_mesh()
        model = parallelize_qwen3(
            model,
            parallel_dims=dims,
            training=TrainingConfig(
                mixed_precision_param="bfloat16" if gpu else "float32",
                mixed_precision_reduce="float32",
            ),
            parallelism=parallelism,
            compile_config=CompileConfig(enable=config.compile, components=["model"]),
            ac_config=ac,
            dump_folder=os.environ.get("TMPDIR", "/tmp"),
            skip_dp=not ranks.distributed,
        )
    if ranks.distributed:
        disable_fsdp_gradient_division(model)
        if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM: plain SUM, divide by 1
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
    return model


def uses_autocast(device: str, ranks: Ranks) -> bool:
    """bf16 autocast where FSDP's mixed precision does not apply: one process on a GPU."""
    return device.startswith("cuda") and not ranks.distributed


def full_parameters(model: torch.nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole, a copy that later steps leave as it is (a collective
    when sharded: all ranks must call). A CPU parameter's ``.cpu()`` is the parameter
    itself: without the copy, weights kept for a later fold-in would move with the model."""
    out = {}
    for name, param in parameters_of(model).items():
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a new tensor: already a copy
            out[name] = value.cpu() if cpu else value
        else:
            out[name] = value.to("cpu", copy=True) if cpu else value.clone()
    return out


@torch.no_grad()
def load_full_parameters(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors into (possibly sharded) parameters; names and shapes must match."""
    for name, param in matching_parameters(model, tensors).items():
        value = tensors[name]
        if isinstance(param, DTensor):
            local = distribute_tensor(
                value.to(param.device, param.dtype), param.device_mesh, param.placements
            )
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(value)


def torchrun_argv(
    nproc: int,
    argv: Sequence[str],
    *,
    torchrun: str = "torchrun",
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The command that reruns ``python -m crossfed <argv>`` as ``nproc`` ranks per node.

    One node uses ``--standalone``; several use a c10d rendezvous at ``rdzv_endpoint``
    (on Slurm: the first node of the allocation, with one ``srun`` task per node).
    """
    if nproc < 1 or nnodes < 1:
        raise DistributedError(f"torchrun needs nproc >= 1 and nnodes >= 1, got {nproc}, {nnodes}")
    cmd = shlex.split(torchrun)
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        if not rdzv_endpoint:
            raise DistributedError("a multi-node torchrun needs a rendezvous endpoint host:port")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    # `--` ends torchrun's own options: its parser would otherwise take crossfed's `--log`
    # for an ambiguous abbreviation of `--log-dir`/`--logs-specs` and refuse the command
    return [*cmd, f"--nproc-per-node={nproc}", "-m", "--", "crossfed", *argv]


def python_torchrun() -> str:
    """torchrun of this interpreter's environment."""
    return f"{shlex.quote(sys.executable)} -m torch.distributed.run"


def peak_flops(device: str) -> float | None:
    """Peak bf16 FLOP/s of one accelerator (torchtitan's table); None on CPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(torch.cuda.get_device_name(torch.device(device))))


def mfu(tokens_per_s: float, flops_per_token: float | None, device: str, gpus: int) -> float | None:
    """Model FLOPs utilisation of ``gpus`` accelerators at ``tokens_per_s`` (None on CPU)."""
    peak = peak_flops(device)
    if peak is None or not flops_per_token or gpus < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * gpus)


def relaunch_under_torchrun(ranks: int, argv: Sequence[str], launcher: LauncherSection) -> int:
    """Run ``crossfed <argv>`` again as ``ranks`` torchrun processes; returns their exit code.

    ``launcher`` is the run config's ``launcher`` section (command, nnodes, rdzv_endpoint).
    """
    import subprocess

    nnodes = launcher.nnodes
    if ranks % nnodes:
        raise DistributedError(f"{ranks} ranks do not spread evenly over {nnodes} nodes")
    cmd = torchrun_argv(
        ranks // nnodes,
        argv,
        torchrun=launcher.command or python_torchrun(),
        nnodes=nnodes,
        rdzv_endpoint=launcher.rdzv_endpoint,
    )
    return subprocess.call(cmd)
