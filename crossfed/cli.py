"""``crossfed`` command line: one subcommand per thing a rule or a person does."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from crossfed.config import ConfigError, load_run_config, load_sites
from crossfed.fileio import write_atomic
from crossfed.progress import site_prefix


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to the log file alike."""

    def __init__(self, stream: TextIO, log: TextIO, show: bool = True) -> None:
        self._stream, self._log, self._show = stream, log, show

    def write(self, text: str) -> int:
        if self._show:
            self._stream.write(text)
        if not self._log.closed:  # a handler left over after main() returned
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
        if not self._log.closed:
            self._log.flush()

    @property
    def stream(self) -> TextIO:
        """The terminal's stream alone."""
        return self._stream

    @property
    def log(self) -> TextIO:
        """The log file alone (writes after it closed are dropped)."""
        return _Tee(self._stream, self._log, show=False)  # type: ignore[return-value]

    def fileno(self) -> int:  # subprocesses inherit the terminal's stream
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"


#: ``progress``: under ``--log``, what a command prints goes to the log only (set by the workflow)
TERMINAL_ENV = "CROSSFED_TERMINAL"


@contextlib.contextmanager
def _tee_to(log_file: str | None) -> Iterator[None]:
    """With ``--log``: all a command says (stdout, stderr, its traceback) also goes to the log.

    Under ``CROSSFED_TERMINAL=progress`` (the workflow's jobs) the terminal gets only the
    progress lines, warnings and errors; what the command prints goes to the log alone.
    """
    if not log_file:
        yield
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", buffering=1, encoding="utf-8", errors="replace") as log:
        out, err = sys.stdout, sys.stderr
        show_output = os.environ.get(TERMINAL_ENV) != "progress"
        sys.stdout, sys.stderr = _Tee(out, log, show=show_output), _Tee(err, log)
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


class _ForTerminal(logging.Filter):
    """Under ``--log``: the terminal gets progress lines (``crossfed.console``) and warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "crossfed.console" or record.levelno >= logging.WARNING


class _LineFormatter(logging.Formatter):
    """Progress lines as ``HH:MM:SS <line>``; every other record with its level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "crossfed.console":
            return f"{self.formatTime(record, self.datefmt)} {record.getMessage()}"
        return super().format(record)


def _setup_logging(verbose: bool = False) -> None:
    """Log lines to stderr; under ``--log`` every line to the log file and only progress
    lines and warnings to the terminal (the rule log keeps the rest)."""
    fmt = _LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    if isinstance(sys.stderr, _Tee):
        to_log = logging.StreamHandler(sys.stderr.log)
        to_terminal = logging.StreamHandler(sys.stderr.stream)
        to_terminal.addFilter(_ForTerminal())
        handlers: list[logging.Handler] = [to_log, to_terminal]
    else:
        handlers = [logging.StreamHandler(sys.stderr)]
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, handlers=handlers, force=True
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
        write_atomic(path, text + "\n")
    else:
        print(text)


# ---------------------------------------------------------------------- coordinator
def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from crossfed.coordinator.app import KEEP_ALIVE_S, Tokens, create_app
    from crossfed.coordinator.service import Coordinator
    from crossfed.wire.libc import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    every = args.ledger_checkpoint_every
    coordinator = Coordinator(
        Path(args.state_dir),
        keep_models=args.keep_models,
        keep_deltas=args.keep_deltas,
        **({} if every is None else {"ledger_checkpoint_every": every}),
    )
    app = create_app(coordinator, Tokens.load(Path(args.secrets)), max_request_s=args.max_request_s)
    ssl = {}
    if args.ssl_certfile:
        ssl = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        **ssl,
    )
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


def secrets_problem(data: Any) -> str | None:
    """What keeps a parsed secrets file from being extended (None: nothing)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        return f"a mapping with 'admin' and 'sites' expected, found a {type(data).__name__}"
    if "admin" in data and not isinstance(data["admin"], str):
        return "'admin' must be a token (a string)"
    sites = data.get("sites", {})
    if not isinstance(sites, dict):
        return "'sites' must map site names to tokens"
    bad = [name for name, token in sites.items() if not isinstance(token, str)]
    return f"the tokens of sites {bad} are not strings" if bad else None


def cmd_coordinator_secrets(args: argparse.Namespace) -> int:
    """Write (or extend) the coordinator's secrets file: an admin token, one token per site."""
    import yaml

    from crossfed.coordinator.embedded import ensure_secrets

    path = Path(args.out)
    sites = list(dict.fromkeys(args.site or list(load_sites(_config(args)))))
    try:
        existing = yaml.safe_load(path.read_text()) if path.exists() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({exc}); left as it is") from exc
    problem = secrets_problem(existing)
    if problem:
        raise ConfigError(f"{path}: {problem}; left as it is")
    had = set((existing or {}).get("sites") or {}) | ({"admin"} & set(existing or {}))
    data = ensure_secrets(path, sites)
    if path.stat().st_mode & 0o077:  # an older file others can read
        os.chmod(path, 0o600)
        print(f"{path}: made readable by its owner only (mode 0600)")
    new = [who for who in ["admin", *sites] if who not in had]
    print(
        f"{path} (mode 0600): tokens for admin and sites {', '.join(data['sites'])}; "
        + (f"new: {', '.join(new)}" if new else "nothing new, every token kept")
    )
    print(
        "give each site only its own token (sites.<site> in the file) as CROSSFED_TOKEN; the "
        "admin token creates the run"
    )
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
    model is kept in ``<results>/.crossfed/models`` (no rule's output; a site loop that
    trained from it may have put it there already) and hard-linked to ``out``, so a rerun
    that deleted ``out`` finds it there again.
    """
    from crossfed.fileio import kept_model_path, link_or_copy

    kept = kept_model_path(Path(config["results"]), generation)
    if not kept.exists():
        if out.exists():  # secured before the kept copy existed
            link_or_copy(out, kept)
        else:
            client.download_model(generation, kept)
    if not out.exists():
        link_or_copy(kept, out)
    return out


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
    from crossfed.coordinator.embedded import client_for
    from crossfed.coordinator.http_client import Refused
    from crossfed.coordinator.runspec import run_spec
    from crossfed.outer import OuterConfig

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
        if not (Path(config["data"]["dir"]) / "meta.json").exists():
            # a site that joins a run the operator created: its data job comes first
            print("this site's data are not prepared yet; the workflow's init_run job joins")
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
    if reply.get("outer"):  # the outer step the coordinator runs (an unset preset resolved)
        spec = replace(spec, outer=OuterConfig(**reply["outer"]))
    if args.out or not args.resume_only:  # the workflow's hook wants the one-line summary
        _write_json(args.out, {"spec": spec.to_dict(), **reply})
    return 0


# ---------------------------------------------------------------------- sites
def _closed_round(config: dict[str, Any], site: str, round_no: int) -> dict[str, Any] | None:
    """A ``missed`` outcome when the coordinator has closed ``round_no`` already, else None.

    A late site's workflow has a job for every round before the one it joins; those end
    here at once, before torch is imported. A job with a checkpointed, unsent delta goes on
    to the site loop, which resends it (idempotent) whatever the round's state, and so does
    a job whose status request fails (the site loop retries and reports).
    """
    from crossfed.catchup import closed_detail, coordinator_round

    if (Path(config["results"]) / "sites" / site / "pending.json").exists():
        return None
    current = coordinator_round(config, site)
    if current is None or current <= round_no:
        return None
    return {
        "site": site,
        "round": round_no,
        "status": "missed",
        "detail": closed_detail(round_no, current),
        "steps": 0,
        "tokens": 0,
        "compute_s": 0.0,
        "overhead_s": 0.0,
    }


def cmd_site_run(args: argparse.Namespace) -> int:
    config = _config(args)
    sites = load_sites(config)
    if args.site not in sites:  # before torch is imported
        raise ConfigError(f"unknown site {args.site!r}; sites are {list(sites)}")
    if args.round is not None:
        missed = _closed_round(config, args.site, args.round)
        if missed is not None:
            _write_json(args.out, missed)
            print(f"{site_prefix(args.site, args.round)} missed: {missed['detail']}")
            return 0
    import torch

    from crossfed.coordinator.embedded import client_for
    from crossfed.site import SiteRunner
    from crossfed.site.job import relaunch, site_job
    from crossfed.train.distributed import close_ranks, init_ranks
    from crossfed.wire.libc import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    torch.set_num_threads(args.threads)
    code = relaunch(config, args.site, sys.argv[1:])
    if code is not None:
        return code
    if args.round is None:
        return _site_chain(args, config)
    entry, settings = site_job(config, args.site, args.plan)
    if entry.get("submit") is False:
        record = {"site": args.site, "round": args.round, "status": "not_planned"}
        _write_json(args.out, {**record, "detail": entry.get("reason", "")})
        return 0
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
    from crossfed.progress import mfu_text

    loss = "n/a" if outcome.loss_mean is None else f"{outcome.loss_mean:.4f}"
    print(
        f"{args.site:<10} round {args.round}/{config['rounds']}  {outcome.status}: "
        f"{outcome.tokens:,} tokens, loss {loss}, {outcome.tokens_per_s:,.0f} tok/s, "
        f"MFU {mfu_text(outcome.mfu)} {outcome.detail}".rstrip()
    )
    return 0


def _site_chain(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """Rounds back to back in one job (crossfed.site.loop); writes the chain outcome."""
    from crossfed.site.job import chain_job
    from crossfed.site.loop import ChainError

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
        f"{site_prefix(args.site)} chain job stopped ({outcome.stopped}): "
        f"{outcome.trained} rounds trained, "
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
            logging.getLogger("crossfed.round").info(
                "round %d: open, %d deltas in (%s)",
                args.round,
                len(info["deltas"]),
                ", ".join(d["site"] for d in info["deltas"]) or "none yet",
            )
            last = seen
        if deadline and time.monotonic() > deadline:
            print(f"round {args.round} still open after {args.timeout_s}s", file=sys.stderr)
            return 3
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    report = info["report"]
    logging.getLogger("crossfed.round").info(
        "round %d closed (%s): %s, %d tokens, generation %d, merge %.2fs",
        args.round,
        report["reason"],
        ", ".join(report["contributors"]),
        report["tokens"],
        report["generation"],
        report["merge_s"],
    )
    _round_progress(config, info)
    if args.model_out:  # secure the new global model now: the coordinator keeps only a few
        _secure_model(config, client, report["generation"], Path(args.model_out))
    _write_json(args.out, info)
    return 0


def _round_progress(config: dict[str, Any], info: dict[str, Any]) -> None:
    """The run-level progress line of a closed round: round k of N and the run's ETA."""
    from crossfed.progress import CONSOLE, closed_round_seconds, round_line

    results = Path(config["results"])
    earlier = closed_round_seconds(results, before=info["round_no"])
    seconds = [*earlier, info["closed_at"] - info["opened_at"]]
    CONSOLE.info(round_line(info, config["rounds"], seconds, time.time()))


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Pull the global model of a generation and measure its held-out perplexity."""
    import torch
    from safetensors.torch import load_file

    from crossfed.coordinator.embedded import client_for
    from crossfed.data.windows import WindowStore
    from crossfed.train.distributed import DistributedError, resolve_device
    from crossfed.train.inner import evaluate
    from crossfed.train.model import build_model, load_parameters

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
    from crossfed.progress import CONSOLE

    CONSOLE.info(
        "round %d/%d global model: held-out loss %.4f, perplexity %.2f (%s, %.1fs)",
        args.generation,
        config["rounds"],
        loss,
        ppl,
        device,
        eval_s,
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

    from crossfed.data.windows import read_meta
    from crossfed.train.export import ExportError, export_hf

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


#: the --config default of the reading commands (status, report)
DEFAULT_CONFIG = "config/config.yaml"


def _effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config; with ``--config`` left at its default, the effective config the
    workflow wrote (``<results>/.crossfed/config.yaml``: the profile's and ``--config``
    overrides included) where it exists. ``--set`` applies on top either way."""
    config = _config(args)
    if args.config in (None, DEFAULT_CONFIG):
        written = Path(config["results"]) / ".crossfed" / "config.yaml"
        if written.exists():
            return _config(argparse.Namespace(**{**vars(args), "config": str(written)}))
    return config


def _admin_read(config: dict[str, Any], live: Any, stopped: Any) -> tuple[Any, bool]:
    """``live(client)`` from the running coordinator, else ``stopped(state_dir)`` from the
    state directory it left (an embedded coordinator that has stopped, or one out of reach
    whose state is on this machine). Returns the answer and whether it was live."""
    from crossfed.coordinator.embedded import EndpointError, client_for
    from crossfed.coordinator.http_client import Unreachable
    from crossfed.coordinator.service import CoordinatorError

    state_dir = Path(config["coordinator"]["state_dir"])
    quick = {"retry_budget_s": 3.0} if config["coordinator"]["url"] == "embedded" else {}
    try:
        return live(client_for(config, "admin", **quick)), True
    except (EndpointError, Unreachable) as exc:
        if not (state_dir / "state.sqlite").exists():
            raise
        logging.getLogger(__name__).debug(
            "coordinator not answering (%s); reading %s", exc, state_dir
        )
    try:
        return stopped(state_dir), False
    except CoordinatorError as exc:
        raise ConfigError(exc.message) from exc


def cmd_status(args: argparse.Namespace) -> int:
    """Round k of N, the last held-out perplexity, an ETA and the leases (live or stopped)."""
    from crossfed.coordinator.service import read_status
    from crossfed.progress import closed_round_seconds, evaluations, progress_lines, run_progress

    config = _effective_config(args)
    status, live = _admin_read(config, lambda client: client.status(), read_status)
    results = Path(config["results"])
    seconds = closed_round_seconds(results, before=status["round"])
    closes = [
        json.loads(p.read_text()).get("closed_at") or 0.0
        for p in results.glob("rounds/*/merge.json")
    ]
    open_since = max(closes) if live and closes else None
    progress = run_progress(
        status, config["rounds"], seconds, evaluations(results), open_since, time.time()
    )
    if args.json:
        _write_json(None, {**status, "live": live, "progress": progress})
        return 0
    state = config["coordinator"]["state_dir"]
    where = "coordinator live" if live else f"coordinator stopped; read from {state}"
    print(f"run {config['run_name']} ({where})")
    for line in progress_lines(progress, live):
        print(line)
    print(
        f"generation {status['generation']}  global step {status['global_step']}  epoch "
        f"{status['epoch']}  committed {status['blocks_committed_in_epoch']}/"
        f"{status['blocks_total']} blocks"
    )
    for lease in status["active_leases"]:
        left = lease["expires_at"] - time.time()
        expiry = f"expires in {left:.0f}s" if left > 0 else "expired"
        print(
            f"  lease {lease['lease_id']:>5} {lease['site']:<10} round {lease['round']} "
            f"{lease['consumed']}/{lease['n_blocks']} blocks, {expiry}"
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The report's tables and plots, from the running coordinator or its state directory."""
    from crossfed.coordinator.service import read_ledger
    from crossfed.report import write_report

    config = _effective_config(args)
    ledger, _ = _admin_read(config, lambda client: client.ledger(), read_ledger)
    summary = write_report(config, list(load_sites(config)), Path(config["results"]), ledger)
    from crossfed.progress import CONSOLE

    CONSOLE.info(
        "final held-out perplexity %.2f after %d rounds (%.2f at round 0), %s tokens from %s",
        summary["val_perplexity"],
        summary["rounds"],
        summary["initial_val_perplexity"],
        f"{summary['tokens']:,}",
        ", ".join(summary["sites"]),
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; an option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = default is not None and default is not False and default is not argparse.SUPPRESS
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """crossfed's parsers (subcommands' too): descriptions and examples kept as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _examples(*lines: str) -> str:
    """An epilog of example command lines."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _group(sub: argparse._SubParsersAction, name: str, text: str, *examples: str) -> Any:
    """A command with subcommands; without one it prints its help."""
    parser = sub.add_parser(
        name, help=text, description=text[:1].upper() + text[1:] + ".",
        epilog=_examples(*examples),
    )  # fmt: skip
    parser.set_defaults(func=None, help_of=parser)
    return parser.add_subparsers(dest="action", metavar="ACTION", title="actions")


def _last_round(text: str) -> int | str:
    if text == "run":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a round number or 'run'") from None


def _site_name(text: str) -> str:
    if text == "admin" or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a site name (lower-case letter, then up to 31 of a-z 0-9 _ -; "
            "not 'admin')"
        )
    return text


def _non_negative(text: str) -> int:
    """A whole number >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``crossfed`` parser: every subcommand, each with a description and an example."""
    from crossfed import __version__

    parser = _Parser(
        prog="crossfed",
        description="Pool Slurm allocations from several supercomputers into one pre-training "
        "run.\n\nThe workflow (make run, or snakemake --profile <site>) calls these commands in "
        "its rules;\nthey also work by hand. Without a command crossfed prints this help.",
        epilog=_examples(
            "crossfed data prepare --config config/config.yaml",
            "crossfed coordinator secrets --out secrets.yaml --site lumi --site snellius",
            "crossfed status --config config/config.yaml",
            "crossfed export --config config/config.yaml --out hf-model",
            "crossfed COMMAND --help       # what a command does, its options and an example",
        ),
    )
    parser.add_argument("--version", action="version", version=f"crossfed {__version__}")
    parser.add_argument(
        "--log", help="also write everything the command says (output, errors) to this file"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    parser.set_defaults(func=None, help_of=parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    csub = _group(
        sub, "coordinator", "run the coordinator, start or stop the embedded one, write secrets",
        "crossfed coordinator secrets --out secrets.yaml --site lumi --site snellius",
        "crossfed coordinator serve --state-dir state --secrets secrets.yaml --port 8470",
        "crossfed coordinator start --config config/config.yaml",
    )  # fmt: skip
    serve = csub.add_parser(
        "serve",
        help="serve the coordinator HTTP API (foreground)",
        description="Serve the coordinator's HTTP API in the foreground: the run's ledger, "
        "leases, rounds and global\nmodels, for every site (on the coordinator VM, or the "
        "embedded one the workflow starts).",
        epilog=_examples(
            "crossfed coordinator serve --state-dir state --secrets secrets.yaml \\",
            "    --host 0.0.0.0 --port 443 --ssl-certfile fullchain.pem --ssl-keyfile privkey.pem",
        ),
    )
    serve.add_argument(
        "--state-dir", required=True, help="SQLite ledger, blobs and models live here"
    )
    serve.add_argument(
        "--secrets",
        required=True,
        help="YAML with 'admin' and per-site tokens (crossfed coordinator secrets writes it)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=8470, help="TCP port to listen on")
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
    serve.add_argument(
        "--keep-models",
        type=_non_negative,
        default=None,
        metavar="N",
        help="keep the last N generations' global models (bf16, what sites download), so a "
        "site that starts or resumes up to N-1 rounds behind still secures every round's "
        "model; 0 keeps them all (default: 3, as the fp32 masters)",
    )
    serve.add_argument(
        "--keep-deltas",
        action="store_true",
        help="keep every merged delta and generation 0's fp32 master, so the run can be "
        "audited and replayed from its start (bench/soak_check.py); the state directory "
        "grows by each round's deltas",
    )
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    serve.set_defaults(func=cmd_coordinator_serve)
    for name, func, text in (
        ("start", cmd_coordinator_start, "start the embedded coordinator on loopback"),
        ("stop", cmd_coordinator_stop, "stop the embedded coordinator"),
    ):
        p = csub.add_parser(
            name,
            help=text,
            description=f"{text[:1].upper()}{text[1:]} (the workflow's onstart/onsuccess hooks do "
            "this); nothing to do when\nthe config's coordinator.url names a remote coordinator.",
            epilog=_examples(f"crossfed coordinator {name} --config config/config.yaml"),
        )
        _add_config(p)
        p.set_defaults(func=func)
    secrets = csub.add_parser(
        "secrets",
        help="write the secrets file: an admin token and one token per site",
        description="Write the coordinator's secrets file (mode 0600): a random admin token and "
        "one per site.\nAn existing file is extended: tokens it has are kept, sites it lacks get "
        "one. Without --site\nthe sites are the run config's (its sites_file).",
        epilog=_examples(
            "crossfed coordinator secrets --out secrets.yaml --site snellius --site lumi "
            "--site frontier",
            "crossfed coordinator secrets --out secrets.yaml --config config/config.yaml",
        ),
    )
    secrets.add_argument("--out", required=True, help="the secrets file to write or extend")
    secrets.add_argument(
        "--site",
        action="append",
        type=_site_name,
        help="a site that gets a token (repeatable; default: the run config's sites)",
    )
    _add_config(secrets)
    secrets.set_defaults(func=cmd_coordinator_secrets)

    rsub = _group(
        sub, "run", "create, resume or extend the run on the coordinator",
        "CROSSFED_TOKEN=<admin token> crossfed run init --config config/config.yaml --out run.json",
    )  # fmt: skip
    init = rsub.add_parser(
        "init",
        help="create the run (idempotent) from config and data meta",
        description="Create the run on the coordinator from the run config and the data's "
        "meta.json; a run it already\nhas is resumed, or extended when the config has more "
        "rounds. With a site's token the site\njoins the run the operator created (the data "
        "must match).",
        epilog=_examples(
            "CROSSFED_TOKEN=<admin token> crossfed run init --config config/config.yaml "
            "--out run.json",
            "crossfed run init --config config/config.yaml --resume-only",
        ),
    )
    _add_config(init)
    init.add_argument("--out", help="write the run description and the reply (JSON) here")
    init.add_argument("--model-out", help="also download the initial model (generation 0)")
    init.add_argument(
        "--resume-only",
        action="store_true",
        help="only resume or extend a run the coordinator already has (more rounds lengthen "
        "its learning-rate schedule); do nothing if it has none",
    )
    init.set_defaults(func=cmd_run_init)

    ssub = _group(
        sub, "site", "a site's training jobs",
        "crossfed site run --config config/config.yaml --site lumi --round 1",
    )  # fmt: skip
    srun = ssub.add_parser(
        "run",
        help="train outer rounds as a site (one, or a chain in one allocation)",
        description="Train as a site: lease blocks from the coordinator, run H inner steps, "
        "send the delta.\n--round trains one outer round; --through-round trains rounds back "
        "to back in one\nallocation (a Slurm chain job).",
        epilog=_examples(
            "crossfed site run --config config/config.yaml --site lumi --round 3 \\",
            "    --plan results/rounds/3/plan.json --out results/rounds/3/train/lumi.json",
            "crossfed site run --config config/config.yaml --site lumi --through-round run \\",
            "    --until-walltime auto --out outcome.json",
        ),
    )
    _add_config(srun)
    srun.add_argument("--site", required=True, help="this site's name in the sites file")
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
    srun.add_argument("--threads", type=int, default=1, help="CPU threads torch may use")
    srun.add_argument("--out", help="write the outcome (JSON) here")
    srun.set_defaults(func=cmd_site_run)

    rdsub = _group(
        sub, "round", "outer rounds",
        "crossfed round wait --config config/config.yaml --round 3 --timeout-s 3600",
    )  # fmt: skip
    wait = rdsub.add_parser(
        "wait",
        help="wait until the coordinator closes a round",
        description="Wait until the coordinator closes a round (every site in, or the "
        "stragglers' leases expired)\nand applies the outer step; print who contributed, and "
        "keep the new global model.",
        epilog=_examples(
            "crossfed round wait --config config/config.yaml --round 3 \\",
            "    --model-out results/checkpoints/global-3.safetensors",
        ),
    )
    _add_config(wait)
    wait.add_argument("--round", type=int, required=True, help="the round to wait for")
    wait.add_argument(
        "--timeout-s",
        type=float,
        default=0.0,
        help="give up (exit 3) after this many seconds; 0: wait until it closes (default: 0)",
    )
    wait.add_argument("--out", help="write the closed round's report (JSON) here")
    wait.add_argument("--model-out", help="also download the global model the round produced")
    wait.set_defaults(func=cmd_round_wait)

    ckpt = sub.add_parser(
        "evaluate",
        aliases=["checkpoint"],  # its first name, kept for scripts that use it
        help="pull a global model and evaluate it",
        description="Download a generation's global model and measure its held-out loss and "
        "perplexity\n(eval.max_windows windows of the validation split, on eval.device).",
        epilog=_examples(
            "crossfed evaluate --config config/config.yaml --generation 3 \\",
            "    --model-out results/checkpoints/global-3.safetensors --out eval.json",
        ),
    )
    _add_config(ckpt)
    ckpt.add_argument(
        "--generation",
        type=int,
        required=True,
        help="the global model's generation: the round that made it (0: the initial model)",
    )
    ckpt.add_argument("--model-out", required=True, help="where to keep the model (safetensors)")
    ckpt.add_argument("--threads", type=int, default=1, help="CPU threads torch may use")
    ckpt.add_argument("--out", help="write the evaluation (JSON) here (default: print it)")
    ckpt.set_defaults(func=cmd_checkpoint)

    export = sub.add_parser(
        "export",
        help="a global model in Hugging Face format",
        description="Write a global model as a Hugging Face Qwen3 checkpoint, the files "
        "save_pretrained writes:\nmodel.safetensors, config.json, generation_config.json "
        "(generate stops at end of text),\ntokenizer.json and tokenizer_config.json "
        "(model_max_length: the trained seq_len).\ntransformers' AutoModelForCausalLM and "
        "AutoTokenizer load the folder.",
        epilog=_examples(
            "crossfed export --config config/config.yaml --out hf-model",
            "crossfed export --model results/checkpoints/global-4.safetensors --out hf-model-4 "
            "--dtype float32",
        ),
    )
    _add_config(export)
    export.add_argument("--model", help="global model safetensors (default: the newest checkpoint)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the exported weights",
    )
    export.set_defaults(func=cmd_export)

    ledger = sub.add_parser(
        "ledger",
        help="the DARL ledger (paper Table 3)",
        description="Print the DARL ledger: every lease, commit and expiry, from the running "
        "coordinator or,\nwhen it has stopped, from its state directory.",
        epilog=_examples(
            "crossfed ledger --config config/config.yaml",
            "crossfed ledger --config config/config.yaml --format csv --out ledger.csv",
        ),
    )
    _add_config(ledger)
    ledger.add_argument(
        "--format", choices=["table", "csv"], default="table", help="how to print it"
    )
    ledger.add_argument("--out", help="also write CSV here")
    ledger.set_defaults(func=cmd_ledger)

    status = sub.add_parser(
        "status",
        help="round, generation and live leases",
        description="Print where the run stands: round, generation, global step, committed "
        "blocks and live leases.",
        epilog=_examples(
            "crossfed status --config config/config.yaml",
            "crossfed status --config config/config.yaml --json",
        ),
    )
    _add_config(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)

    report = sub.add_parser(
        "report",
        help="final metrics, tables and plots",
        description="Write the run's final metrics (metrics/final.json), per-round and per-site "
        "tables and plots\nunder the config's results directory (the workflow's report rule).",
        epilog=_examples("crossfed report --config results/.crossfed/config.yaml"),
    )
    _add_config(report)
    report.set_defaults(func=cmd_report)

    dsub = _group(
        sub, "data", "data preparation",
        "crossfed data prepare --config config/config.yaml",
        "crossfed data prepare --out data --input c4/en --tokenizer tokenizer.json",
    )  # fmt: skip
    from crossfed.data.commands import add_parser as add_prepare

    add_prepare(dsub)
    try:
        from crossfed.sched.commands import add_parsers as add_sched
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
    if args.func is None:  # `crossfed` or a command group alone: its help, as pip does
        args.help_of.print_help()
        return 0
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"crossfed: config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from crossfed.coordinator.embedded import EndpointError
        from crossfed.coordinator.http_client import Refused, Unreachable

        if isinstance(exc, Refused | Unreachable | EndpointError):
            print(f"crossfed: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
