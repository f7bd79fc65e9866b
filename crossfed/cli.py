"""``crossfed`` command line: one subcommand per thing a rule or a person does."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from crossfed.config import ConfigError, load_run_config, load_sites


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to the log file alike."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._stream.write(text)
        if not self._log.closed:  # a handler left over after main() returned
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
        if not self._log.closed:
            self._log.flush()

    def fileno(self) -> int:  # subprocesses inherit the terminal's stream
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"


@contextlib.contextmanager
def _tee_to(log_file: str | None) -> Iterator[None]:
    """With ``--log``: all a command says (stdout, stderr, its traceback) also goes to the log."""
    if not log_file:
        yield
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", buffering=1, encoding="utf-8", errors="replace") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield
        except (Exception, KeyboardInterrupt):  # the terminal gets it from the interpreter
            log.write(traceback.format_exc())
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err


def _log_file(argv: list[str] | None) -> str | None:
    """``--log`` of the command line, read before the full parse so usage errors reach it."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--log")
    known, _ = early.parse_known_args(argv)
    return known.log


def _setup_logging(verbose: bool = False) -> None:
    """Log lines to stderr (which ``--log`` tees to the log file)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stderr)],
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {}
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value[:1] in "[{0123456789-tf" else value
    return load_run_config(Path(args.config) if args.config else None, overrides)


def _write_json(path: str | None, data: Any) -> None:
    text = json.dumps(data, indent=2, default=str)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    else:
        print(text)


# ---------------------------------------------------------------------- coordinator
def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from crossfed.coordinator.app import Tokens, create_app
    from crossfed.coordinator.service import Coordinator
    from crossfed.transport import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    every = args.ledger_checkpoint_every
    coordinator = Coordinator(
        Path(args.state_dir), **({} if every is None else {"ledger_checkpoint_every": every})
    )
    app = create_app(coordinator, Tokens.load(Path(args.secrets)), max_request_s=args.max_request_s)
    ssl = {}
    if args.ssl_certfile:
        ssl = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **ssl)
    return 0


def cmd_coordinator_start(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import start_embedded

    config = _config(args)
    if config["coordinator"]["url"] != "embedded":
        print(f"coordinator is remote ({config['coordinator']['url']}); nothing to start")
        return 0
    url = start_embedded(config, list(load_sites(config)))
    print(f"crossfed coordinator listening on {url} (state: {config['coordinator']['state_dir']})")
    return 0


def cmd_coordinator_stop(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import stop_embedded

    config = _config(args)
    if config["coordinator"]["url"] == "embedded" and stop_embedded(config):
        print("crossfed coordinator stopped")
    return 0


def _join_run(client: Any, spec: Any) -> dict[str, Any]:
    """Without the admin token a site joins the run the operator created, if its data match."""
    from crossfed.darl.blockspace import BlockSpace

    status = client.status()
    digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
    if status["digest"] != digest:
        raise ConfigError(
            f"the coordinator's run has block-space digest {status['digest'][:16]}..., this "
            f"site's data give {digest[:16]}... (N={spec.n_windows}, K={spec.block_size}, "
            f"seed={spec.data_seed}); prepare the same data with the same settings"
        )
    return {"created": False, "joined": True, **status}


def _secure_model(config: dict[str, Any], client: Any, generation: int, out: Path) -> Path:
    """Keep a global model where the workflow cannot delete it, and link it to ``out``.

    The coordinator keeps only its last few generations, so the workflow's copy would be
    the only one left; Snakemake deletes a rule's outputs before it reruns the rule. The
    model is kept in ``<results>/.crossfed/models`` (no rule's output) and hard-linked to
    ``out``, so a rerun that deleted ``out`` finds it there again.
    """
    kept = Path(config["results"]) / ".crossfed" / "models" / f"global-{generation}.safetensors"
    if not kept.exists():
        if out.exists():  # secured before the kept copy existed
            _link_or_copy(out, kept)
        else:
            client.download_model(generation, kept)
    if not out.exists():
        _link_or_copy(kept, out)
    return out


def _link_or_copy(source: Path, dest: Path) -> None:
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.link")
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)


def _warn_schedule(status: dict[str, Any], spec: Any) -> None:
    """A site whose config has more rounds than the coordinator's run trains them at the floor."""
    theirs = (status.get("schedule") or {}).get("total_steps")
    ours = spec.schedule.total_steps
    if theirs is not None and theirs != ours:
        print(
            f"warning: the coordinator's run has a learning-rate schedule of {theirs} inner "
            f"steps, this config's rounds make {ours}; the operator extends the run with "
            "`crossfed run init` and the new rounds (rounds past the schedule train at its "
            "floor)",
            file=sys.stderr,
        )


def cmd_run_init(args: argparse.Namespace) -> int:
    from crossfed.coordinator.client import Refused
    from crossfed.coordinator.embedded import client_for
    from crossfed.launch import run_spec

    config = _config(args)
    client = client_for(config, "admin")
    if args.resume_only:
        try:
            client.status()
        except Refused as exc:
            if exc.code != "no_run":
                raise
            print("no run on the coordinator yet; the workflow's init_run job creates it")
            return 0
    spec = run_spec(config, load_sites(config))
    try:
        reply = client.init_run(spec.to_dict())
    except Refused as exc:
        if exc.code != "forbidden":
            raise
        reply = _join_run(client, spec)  # a site token: the operator created the run
        _warn_schedule(reply, spec)
    state = "created" if reply["created"] else "extended" if reply.get("extended") else "resumed"
    print(
        f"run {state}: round {reply['round']}, generation {reply['generation']}, "
        f"{reply['blocks_total']} blocks of {spec.block_size} windows, "
        f"digest {reply['digest'][:12]}"
    )
    if args.model_out:  # the initial model, for the round-0 evaluation
        _secure_model(config, client, 0, Path(args.model_out))
    _write_json(args.out, {"spec": spec.to_dict(), **reply})
    return 0


# ---------------------------------------------------------------------- sites
def cmd_site_run(args: argparse.Namespace) -> int:
    import torch

    from crossfed.coordinator.embedded import client_for
    from crossfed.launch import site_settings
    from crossfed.site import SiteRunner
    from crossfed.train.distributed import (
        close_ranks,
        init_ranks,
        relaunch_under_torchrun,
        under_torchrun,
    )
    from crossfed.transport import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    config = _config(args)
    sites = load_sites(config)
    if args.site not in sites:
        raise ConfigError(f"unknown site {args.site!r}; sites are {list(sites)}")
    torch.set_num_threads(args.threads)
    if args.round is None:
        return _site_chain(args, config)
    accumulation = None
    if args.plan and Path(args.plan).exists():
        plan = json.loads(Path(args.plan).read_text())
        entry = plan.get("sites", {}).get(args.site, {})
        accumulation = entry.get("accumulation")
        if entry and entry.get("submit") is False:
            _write_json(
                args.out,
                {
                    "site": args.site,
                    "round": args.round,
                    "status": "not_planned",
                    "detail": entry.get("reason", ""),
                },
            )
            return 0
    settings = site_settings(config, args.site, sites[args.site], accumulation)
    if settings.launcher == "torchrun" and not under_torchrun():
        return relaunch_under_torchrun(settings.inner.ranks, sys.argv[1:], config["launcher"])
    ranks = init_ranks(settings.device)
    client = client_for(config, args.site) if ranks.main else None
    try:
        outcome = SiteRunner(settings, client, ranks).run_round(args.round)
    finally:
        close_ranks(ranks)
    if not ranks.main:
        return 0
    from dataclasses import asdict

    _write_json(args.out, asdict(outcome))
    print(
        f"[{args.site} r{args.round}] {outcome.status}: {outcome.tokens} tokens, "
        f"loss {outcome.loss_mean}, {outcome.tokens_per_s:.0f} tok/s {outcome.detail}"
    )
    return 0


def _site_chain(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """Several rounds in one allocation (crossfed.chain); writes the chain outcome."""
    from crossfed.chain import ChainError, chain_job, relaunch_ranks
    from crossfed.train.distributed import under_torchrun

    if config["launcher"]["kind"] == "torchrun" and not under_torchrun():
        ranks = load_sites(config)[args.site]["ranks"]
        return relaunch_ranks(ranks, sys.argv[1:], config["launcher"])
    template = args.round_out or str(
        Path(config["results"]) / "rounds" / "{round}" / "train" / f"{args.site}.json"
    )
    try:
        outcome = chain_job(
            config,
            args.site,
            through_round=config["rounds"] if args.through_round == "run" else args.through_round,
            plan_path=args.plan,
            until_walltime=args.until_walltime,
            round_out=template,
        )
    except ChainError as exc:
        raise ConfigError(str(exc)) from exc
    if outcome is None:  # a torchrun rank other than 0
        return 0
    print(
        f"[{args.site}] chain job stopped ({outcome.stopped}): {outcome.trained} rounds trained, "
        f"coordinator at round {outcome.next_round}; next job: {outcome.next_job} "
        f"{outcome.detail}"
    )
    if outcome.stopped == "too_short":  # fail loudly: the workflow cannot carry on this way
        raise ConfigError(f"site {args.site}: {outcome.detail}")
    _write_json(args.out, outcome.to_dict())
    return 0


# ---------------------------------------------------------------------- rounds
def cmd_round_wait(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import client_for

    config = _config(args)
    client = client_for(config, "admin")
    deadline = time.monotonic() + args.timeout_s if args.timeout_s else None
    delay, last = 0.2, None
    while True:
        info = client.round_info(args.round)
        if info["status"] == "closed":
            break
        seen = (len(info["deltas"]),)
        if seen != last:
            print(
                f"round {args.round}: open, {len(info['deltas'])} deltas in "
                f"({', '.join(d['site'] for d in info['deltas']) or 'none yet'})",
                flush=True,
            )
            last = seen
        if deadline and time.monotonic() > deadline:
            print(f"round {args.round} still open after {args.timeout_s}s", file=sys.stderr)
            return 3
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    report = info["report"]
    print(
        f"round {args.round} closed ({report['reason']}): {', '.join(report['contributors'])}, "
        f"{report['tokens']} tokens, generation {report['generation']}, "
        f"merge {report['merge_s']:.2f}s"
    )
    if args.model_out:  # secure the new global model now: the coordinator keeps only a few
        _secure_model(config, client, report["generation"], Path(args.model_out))
    _write_json(args.out, info)
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Pull the global model of a generation and measure its held-out perplexity."""
    import torch
    from safetensors.torch import load_file

    from crossfed.coordinator.embedded import client_for
    from crossfed.train.distributed import DistributedError, resolve_device
    from crossfed.train.inner import evaluate
    from crossfed.train.model import build_model, load_parameters
    from crossfed.train.windows import WindowStore

    config = _config(args)
    try:
        device = resolve_device(config["eval"].get("device", "auto"), "eval.device")
    except DistributedError as exc:
        raise ConfigError(str(exc)) from exc
    torch.set_num_threads(args.threads)
    client = client_for(config, "admin")
    t0 = time.perf_counter()
    path = client.download_model(args.generation, Path(args.model_out))
    download_s = time.perf_counter() - t0
    val = WindowStore.open(Path(config["data"]["dir"]), "val")
    model = build_model(config["model"]["flavour"], vocab_size=val.vocab_size, device=device)
    load_parameters(model, load_file(str(path), device=device))
    t1 = time.perf_counter()
    loss, ppl = evaluate(
        model,
        val.windows,
        val.n_windows,
        batch=config["eval"]["batch"],
        max_windows=config["eval"]["max_windows"],
        device=device,
    )
    eval_s = time.perf_counter() - t1
    print(
        f"generation {args.generation}: held-out loss {loss:.4f}, perplexity {ppl:.2f} "
        f"({device}, {eval_s:.1f}s)"
    )
    _write_json(
        args.out,
        {
            "generation": args.generation,
            "val_loss": loss,
            "val_perplexity": ppl,
            "eval_s": eval_s,
            "download_s": download_s,
            "device": device,
        },
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a global model in the Hugging Face layout, as ``save_pretrained`` would."""
    from safetensors.torch import load_file

    from crossfed.train.export import ExportError, export_hf
    from crossfed.train.windows import read_meta

    config = _config(args)
    model = Path(args.model) if args.model else None
    if model is None:
        found = sorted(
            Path(config["results"]).glob("checkpoints/global-*.safetensors"),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]),
        )
        if not found:
            raise ConfigError(f"no global model under {config['results']}/checkpoints; use --model")
        model = found[-1]
    if not model.exists():
        raise ConfigError(f"model file not found: {model}")
    data = Path(config["data"]["dir"])
    meta = read_meta(data)
    tokenizer = data / "tokenizer.json"
    try:
        out = export_hf(
            load_file(str(model)),
            config["model"]["flavour"],
            int(meta["vocab_size"]),
            Path(args.out),
            seq_len=int(meta["seq_len"]),
            eos_id=int(meta["eos_id"]),
            dtype=args.dtype,
            tokenizer=tokenizer if tokenizer.exists() else None,
        )
    except ExportError as exc:
        raise ConfigError(str(exc)) from exc
    print(
        f"exported {model} as a Hugging Face Qwen3 model to {out} (context {meta['seq_len']}, "
        f"eos id {meta['eos_id']}); load it with AutoModelForCausalLM.from_pretrained({str(out)!r})"
    )
    return 0


# ---------------------------------------------------------------------- reading
def cmd_ledger(args: argparse.Namespace) -> int:
    import pandas as pd

    from crossfed.coordinator.embedded import EndpointError, client_for

    config = _config(args)
    try:
        records = client_for(config, "admin").ledger()
    except EndpointError:  # the embedded coordinator has stopped: read its state directly
        from crossfed.coordinator.service import read_ledger

        records = read_ledger(Path(config["coordinator"]["state_dir"]))
    frame = pd.DataFrame(records)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
    if args.format == "csv":
        print(frame.to_csv(index=False), end="")
    else:
        print(frame.to_string(index=False))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import client_for

    config = _config(args)
    status = client_for(config, "admin").status()
    if args.json:
        _write_json(None, status)
        return 0
    print(
        f"round {status['round']}  generation {status['generation']}  global step "
        f"{status['global_step']}  epoch {status['epoch']}  committed "
        f"{status['blocks_committed_in_epoch']}/{status['blocks_total']} blocks"
    )
    for lease in status["active_leases"]:
        print(
            f"  lease {lease['lease_id']:>5} {lease['site']:<10} round {lease['round']} "
            f"{lease['consumed']}/{lease['n_blocks']} blocks, expires in "
            f"{lease['expires_at'] - time.time():.0f}s"
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from crossfed.report import write_report

    config = _config(args)
    summary = write_report(config, list(load_sites(config)), Path(config["results"]))
    print(
        f"final held-out perplexity {summary['val_perplexity']:.2f} after {summary['rounds']} "
        f"rounds, {summary['tokens']} tokens from {', '.join(summary['sites'])}"
    )
    print(f"metrics: {Path(config['results']) / 'metrics' / 'final.json'}")
    return 0


# ---------------------------------------------------------------------- parser
def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config/config.yaml", help="run config YAML")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a top-level config key (repeatable)",
    )


def _last_round(text: str) -> int | str:
    if text == "run":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a round number or 'run'") from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossfed",
        description="Pool Slurm allocations from several supercomputers into one pre-training run.",
    )
    parser.add_argument(
        "--log", help="also write everything the command says (output, errors) to this file"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="run or control the coordinator service")
    csub = coord.add_subparsers(dest="action", required=True)
    serve = csub.add_parser("serve", help="serve the coordinator HTTP API (foreground)")
    serve.add_argument(
        "--state-dir", required=True, help="SQLite ledger, blobs and models live here"
    )
    serve.add_argument("--secrets", required=True, help="YAML with 'admin' and per-site tokens")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.add_argument(
        "--max-request-s",
        type=_positive_seconds,
        default=120.0,
        help="cut a weight transfer after this long; the client resumes it (default: 120)",
    )
    serve.add_argument(
        "--ledger-checkpoint-every",
        type=int,
        help="checkpoint the DARL lease book every N ledger events, so a restart replays "
        "only the events since (default: 10000; 0: never)",
    )
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this certificate")
    serve.add_argument("--ssl-keyfile")
    serve.set_defaults(func=cmd_coordinator_serve)
    for name, func, text in (
        ("start", cmd_coordinator_start, "start the embedded coordinator"),
        ("stop", cmd_coordinator_stop, "stop the embedded coordinator"),
    ):
        p = csub.add_parser(name, help=text)
        _add_config(p)
        p.set_defaults(func=func)

    run = sub.add_parser("run", help="create or resume the run on the coordinator")
    rsub = run.add_subparsers(dest="action", required=True)
    init = rsub.add_parser("init", help="create the run (idempotent) from config and data meta")
    _add_config(init)
    init.add_argument("--out")
    init.add_argument("--model-out", help="also download the initial model (generation 0)")
    init.add_argument(
        "--resume-only",
        action="store_true",
        help="only resume or extend a run the coordinator already has (more rounds lengthen "
        "its learning-rate schedule); do nothing if it has none",
    )
    init.set_defaults(func=cmd_run_init)

    site = sub.add_parser("site", help="site jobs")
    ssub = site.add_subparsers(dest="action", required=True)
    srun = ssub.add_parser("run", help="train one outer round as a site")
    _add_config(srun)
    srun.add_argument("--site", required=True)
    which = srun.add_mutually_exclusive_group(required=True)
    which.add_argument("--round", type=int, help="train this one outer round")
    which.add_argument(
        "--through-round",
        type=_last_round,
        help="chain: train the current round and the ones after it, back to back, up to this "
        "one ('run': the config's last round, so an extended run needs no other command)",
    )
    srun.add_argument(
        "--until-walltime",
        default="none",
        help="chain: start no round that would end after the walltime: 'auto' (the Slurm "
        "allocation's end), 'none', or seconds from now",
    )
    srun.add_argument(
        "--round-out",
        help="chain: per-round record path with {round} (default: "
        "<results>/rounds/{round}/train/<site>.json)",
    )
    srun.add_argument("--plan", help="plan JSON (accumulation, whether to submit)")
    srun.add_argument("--threads", type=int, default=1)
    srun.add_argument("--out")
    srun.set_defaults(func=cmd_site_run)

    rnd = sub.add_parser("round", help="outer rounds")
    rdsub = rnd.add_subparsers(dest="action", required=True)
    wait = rdsub.add_parser("wait", help="wait until the coordinator closes a round")
    _add_config(wait)
    wait.add_argument("--round", type=int, required=True)
    wait.add_argument("--timeout-s", type=float, default=0.0)
    wait.add_argument("--out")
    wait.add_argument("--model-out", help="also download the global model the round produced")
    wait.set_defaults(func=cmd_round_wait)

    ckpt = sub.add_parser("checkpoint", help="pull a global model and evaluate it")
    _add_config(ckpt)
    ckpt.add_argument("--generation", type=int, required=True)
    ckpt.add_argument("--model-out", required=True)
    ckpt.add_argument("--threads", type=int, default=1)
    ckpt.add_argument("--out")
    ckpt.set_defaults(func=cmd_checkpoint)

    export = sub.add_parser("export", help="a global model in Hugging Face format")
    _add_config(export)
    export.add_argument("--model", help="global model safetensors (default: the newest checkpoint)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    export.set_defaults(func=cmd_export)

    ledger = sub.add_parser("ledger", help="the DARL ledger (paper Table 3)")
    _add_config(ledger)
    ledger.add_argument("--format", choices=["table", "csv"], default="table")
    ledger.add_argument("--out", help="also write CSV here")
    ledger.set_defaults(func=cmd_ledger)

    status = sub.add_parser("status", help="round, generation and live leases")
    _add_config(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    report = sub.add_parser("report", help="final metrics, tables and plots")
    _add_config(report)
    report.set_defaults(func=cmd_report)

    data = sub.add_parser("data", help="data preparation")
    dsub = data.add_subparsers(dest="action", required=True)
    from crossfed.train.prepare import add_parser as add_prepare

    add_prepare(dsub)
    try:
        from crossfed.sched.cli import add_parsers as add_sched
    except ImportError:  # pragma: no cover - scheduler extras absent
        add_sched = None
    if add_sched is not None:
        add_sched(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; with ``--log`` everything it says also lands in the log file."""
    with _tee_to(_log_file(argv)):
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"crossfed: config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from crossfed.coordinator.client import Refused, Unreachable
        from crossfed.coordinator.embedded import EndpointError

        if isinstance(exc, Refused | Unreachable | EndpointError):
            print(f"crossfed: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
