"""Overlapped rounds on one GPU site: the real workflow, then evaluation and export, one JSON line.

Runs crossfed's own workflow (``snakemake --profile profiles/local``: the embedded corpus
prepared by ``crossfed data prepare``, an embedded coordinator on loopback, the site loop,
the coordinator's merges, ``crossfed evaluate`` of every generation, ``crossfed report``)
with ONE site training on ``--device`` and ``overlap.enabled: true``, then writes the final
global model with ``crossfed export`` (the Hugging Face layout: model.safetensors,
config.json, tokenizer). Everything is local; nothing is downloaded. The run lives in
``--workdir`` (its own Snakemake directory, config, sites file, data, coordinator state).

The last line printed is one JSON object: device, flavour, rounds, tokens_per_s (median over
the site's accepted rounds), mfu (median; null on CPU), goodput and val_perplexity (from
metrics/final.json), the export folder, overlap, and what the overlap did (the phases that
folded the merged model in and at which step, transfer seconds hidden beside training and
exposed, seconds waited for a late merge at a phase's end).

    .venv/bin/python scripts/gpu_overlap.py                        # Qwen3-0.6B on cuda, 3 rounds
    .venv/bin/python scripts/gpu_overlap.py --flavour tiny --device cpu --rounds 2 \\
        --inner-steps 10 --seq-len 128 --workdir /tmp/gpu-overlap-cpu   # the CPU proof
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from crossfed.darl.leases import lease_blocks
from crossfed.flavours import flavour_error

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SITE = "gpu"  # the one site's name in the generated sites file


class ScriptError(RuntimeError):
    """A bad argument or a failed stage, with what to do about it."""


def run_config(base: dict[str, Any], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The repository's run config with this run's settings: one site on ``args.device``,
    overlapped rounds, every path under ``workdir`` (pure)."""
    config = copy.deepcopy(base)
    results = workdir / "results"
    config.update(
        run_name=f"gpu-overlap-{args.flavour}".replace(".", "_"),
        rounds=args.rounds,
        results=str(results),
        sites_file=str(workdir / "sites.yaml"),
        sites=[],
        here=[],
    )
    config.setdefault("model", {}).update(flavour=args.flavour, device=args.device)
    config.setdefault("data", {}).update(
        dir=str(workdir / "data"), inputs=[], tokenizer=None, seq_len=args.seq_len
    )
    inner = config.setdefault("inner", {})
    inner["steps"] = args.inner_steps  # the warmup: the run's default, a tenth of its steps
    config["overlap"] = {"enabled": True, "rule": args.overlap_rule}
    config.setdefault("eval", {}).update(device=args.device)
    config["coordinator"] = {
        **config.get("coordinator", {}),
        "url": "embedded",
        "state_dir": str(results / "coordinator"),
        "secrets": str(results / "coordinator" / "secrets.yaml"),
        "host": "127.0.0.1",
        "port": 0,
    }
    return config


def sites_file(args: argparse.Namespace) -> dict[str, Any]:
    """One site without a batch scheduler: the job runs here, on ``args.device`` (pure)."""
    return {
        "sites": {
            SITE: {
                "ranks": 1,
                "micro_batch": args.micro_batch,
                "accumulation": 1,
                "slowdown": 1.0,
                "rtt_ms": 0,
                "scheduler": "none",
                "transport": "direct",
                # the planner's prior until round 1 is measured (docs/benchmarks.md: one H200, 0.6B)
                "tokens_per_s_per_gpu": 48000 if args.device.startswith("cuda") else 2000,
            }
        }
    }


def data_fits(meta: dict[str, Any], config: dict[str, Any], micro_batch: int) -> str | None:
    """Why the rounds would outrun one pass over the prepared windows, or None (pure).

    Each round leases the blocks of H steps x B windows; a site one round ahead holds the
    next round's lease before this one commits, and the next epoch opens only once every
    block of this one is committed, so the run's rounds must fit in one epoch's blocks.
    """
    block = int(config["data"]["block_size"])
    blocks = int(meta["n_windows"]) // block
    rounds, steps = int(config["rounds"]), int(config["inner"]["steps"])
    need = rounds * lease_blocks(steps, micro_batch, 1, 1, block)
    if need <= blocks:
        return None
    fit = max(0, blocks // rounds * block // micro_batch)
    return (
        f"the embedded corpus holds {meta['n_windows']} training windows of seq_len "
        f"{meta['seq_len']} ({blocks} blocks of {block}); {rounds} rounds of {steps} steps x "
        f"{micro_batch} windows need {need} blocks: use --inner-steps {fit} or fewer, fewer "
        "--rounds, a smaller --micro-batch or a shorter --seq-len"
    )


def _float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def summarise(
    final: dict[str, Any], site_rows: list[dict[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    """The JSON line from metrics/final.json and metrics/sites.csv (pure)."""
    accepted = [r for r in site_rows if r.get("status") == "accepted"]
    rates = [v for r in accepted if (v := _float(r.get("tokens_per_s"))) is not None]
    mfus = [v for r in accepted if (v := _float(r.get("mfu"))) is not None]
    folded = [r for r in accepted if _float(r.get("fold_step")) is not None]
    return {
        "device": args.device,
        "flavour": args.flavour,
        "rounds": final["rounds"],
        "inner_steps": args.inner_steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_by_round": rates,
        "mfu": statistics.median(mfus) if mfus else None,
        "goodput": final.get("goodput"),
        "val_perplexity": final["val_perplexity"],
        "initial_val_perplexity": final["initial_val_perplexity"],
        "tokens": final["tokens"],
        "overlap": True,
        "overlap_rule": args.overlap_rule,
        "rounds_folded": len(folded),
        "fold_steps": [int(float(r["fold_step"])) for r in folded],
        "comms_hidden_s": sum(_float(r.get("comms_hidden_s")) or 0.0 for r in accepted),
        "comms_exposed_s": sum(_float(r.get("comms_exposed_s")) or 0.0 for r in accepted),
        "merge_wait_s": sum(_float(r.get("merge_wait_s")) or 0.0 for r in accepted),
        "run_wall_s": final.get("wall_s"),
    }


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot run, before anything starts."""
    error = flavour_error(args.flavour)
    if error:
        raise ScriptError(f"--flavour: {error}")
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        raise ScriptError(f"--device: {args.device!r} is not cpu, cuda or cuda:N")
    for name in ("rounds", "inner_steps", "seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            raise ScriptError(f"--{name.replace('_', '-')} must be at least 1")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ScriptError(
                f"--device {args.device}: torch {torch.__version__} sees no GPU here; install the "
                "site's CUDA or ROCm torch build, or pass --device cpu"
            )
    if importlib.util.find_spec("transformers") is None:
        raise ScriptError(
            "crossfed export needs transformers: pip install -e '.[hf]' in the crossfed checkout"
        )
    workdir = Path(args.workdir)
    if workdir.exists() and any(workdir.iterdir()):
        raise ScriptError(f"--workdir {workdir} is not empty; name a new folder (or remove it)")


def _stream(what: str, cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> None:
    """Run ``cmd``, its output to stderr and ``log_path``; raise naming the log on failure."""
    with log_path.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            sys.stderr.write(line)
        code = proc.wait()
    if code:
        raise ScriptError(f"{what} exited {code}; its output is in {log_path}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The workflow, the export and the summary; the JSON line's object."""
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config = run_config(base, args, workdir)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (workdir / "sites.yaml").write_text(yaml.safe_dump(sites_file(args), sort_keys=False))
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    t0 = time.perf_counter()
    # crossfed's own prepare step (the workflow's prepare_data finds it done), first, so
    # that a run the corpus cannot feed is refused before any training starts
    _stream(
        "crossfed data prepare",
        [sys.executable, "-m", "crossfed", "data", "prepare", "--config",
         str(workdir / "config.yaml")],
        workdir / "prepare.log",
        env,
        workdir,
    )  # fmt: skip
    meta = json.loads((workdir / "data" / "meta.json").read_text())
    error = data_fits(meta, config, args.micro_batch)
    if error:
        raise ScriptError(error)
    _stream(
        "the workflow (snakemake)",
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / "local"),
            "--directory",
            str(workdir),
            "--configfile",
            str(workdir / "config.yaml"),
            "--cores",
            str(args.cores),
        ],
        workdir / "snakemake.log",
        env,
        workdir,
    )
    workflow_s = time.perf_counter() - t0
    results = Path(config["results"])
    export = workdir / "export"
    t1 = time.perf_counter()
    _stream(
        "crossfed export",
        [
            sys.executable,
            "-m",
            "crossfed",
            "--log",
            str(workdir / "export.log"),
            "export",
            "--config",
            str(results / ".crossfed" / "config.yaml"),  # the run's effective config
            "--model",
            str(results / "checkpoints" / f"global-{args.rounds}.safetensors"),
            "--out",
            str(export),
        ],
        workdir / "export-terminal.log",
        env,
        workdir,
    )
    export_s = time.perf_counter() - t1
    missing = [f for f in ("model.safetensors", "config.json") if not (export / f).is_file()]
    if missing:
        raise ScriptError(f"export wrote no {', '.join(missing)} in {export}")
    final = json.loads((results / "metrics" / "final.json").read_text())
    with (results / "metrics" / "sites.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    summary = summarise(final, rows, args)
    summary.update(
        export=str(export),
        workdir=str(workdir),
        workflow_s=round(workflow_s, 1),
        export_s=round(export_s, 1),
    )
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default="0.6B", help="model flavour (default: Qwen3-0.6B)")
    p.add_argument("--rounds", type=int, default=3, help="outer rounds (default: 3)")
    p.add_argument(
        "--inner-steps",
        type=int,
        default=16,
        help="H inner steps a round (default 16: 3 rounds of 8 windows of 2048 tokens a step "
        "take 48 of the embedded corpus's about 62 blocks)",
    )
    p.add_argument("--device", default="cuda", help="the site's device: cuda, cuda:N or cpu")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
    p.add_argument("--micro-batch", type=int, default=8, help="windows per step")
    p.add_argument("--overlap-rule", choices=["rebase", "mix"], default="rebase")
    p.add_argument("--cores", type=int, default=4, help="Snakemake's cores (jobs side by side)")
    p.add_argument(
        "--workdir",
        default=str(REPO / "results" / f"gpu-overlap-{time.strftime('%Y%m%d-%H%M%S')}"),
        help="a new folder for the run (default: results/gpu-overlap-<time>)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_args(args)
        summary = run(args)
    except ScriptError as exc:
        log.error("gpu_overlap: %s", exc)
        return 2
    summary["script_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
