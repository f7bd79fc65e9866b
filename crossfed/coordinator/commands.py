"""The coordinator's commands: ``crossfed coordinator ...``, ``run init``, ``round wait``
and the views of the run (``ledger``, ``status``, ``report``).

Each handler imports what it needs when its command runs, so registering these commands
imports neither the coordinator's service nor torch or pandas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from crossfed.backoff import Backoff
from crossfed.cmdline import (
    DEFAULT_CONFIG,
    add_config,
    examples,
    group,
    non_negative,
    positive_seconds,
    run_config,
    write_json,
)
from crossfed.config import ConfigError, RunConfig, load_sites


def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from crossfed.coordinator.app import KEEP_ALIVE_S, Tokens, create_app
    from crossfed.coordinator.blobs import BlobError
    from crossfed.coordinator.objectstore import ObjectStoreConfigError, open_object_store
    from crossfed.coordinator.service import Coordinator
    from crossfed.wire.libc import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    every = args.ledger_checkpoint_every
    tokens = Tokens.load(Path(args.secrets))
    try:
        objects = open_object_store(args.blobs, Path(args.secrets)) if args.blobs else None
        merger = _merge_worker(args, objects, tokens.admin)
    except (ObjectStoreConfigError, BlobError) as exc:
        print(f"crossfed coordinator serve: {exc}", file=sys.stderr)
        return 2
    coordinator = Coordinator(
        Path(args.state_dir),
        keep_models=args.keep_models,
        keep_deltas=args.keep_deltas,
        objects=objects,
        merger=merger,
        **({} if every is None else {"ledger_checkpoint_every": every}),
    )
    problem = _worker_problem(coordinator, merger, Path(args.state_dir))
    if problem:
        print(f"crossfed coordinator serve: {problem}", file=sys.stderr)
        return 2
    app = create_app(coordinator, tokens, max_request_s=args.max_request_s)
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


def _merge_worker(args: argparse.Namespace, objects: Any, admin_token: str) -> Any:
    """The merge worker the coordinator hands its byte-heavy work to (``--merge-worker``, else
    the blobs section's ``s3.merge_worker``), checked to answer; None: it does that work
    itself."""
    from crossfed.config.run import EMBEDDED_WORKER
    from crossfed.coordinator.merger import RemoteMerger
    from crossfed.coordinator.objectstore import (
        ObjectStoreConfigError,
        load_blobs_section,
        merge_worker_of,
    )

    url = args.merge_worker
    if url is None and args.blobs:
        url = merge_worker_of(load_blobs_section(Path(args.blobs)))
    if url is None:
        return None
    if objects is None:
        raise ObjectStoreConfigError(
            "a merge worker reads deltas from the object store: it needs blobs.backend: s3"
        )
    if url == EMBEDDED_WORKER:
        raise ObjectStoreConfigError(
            "blobs.s3.merge_worker: embedded is started by the local profile's embedded "
            "coordinator; beside a coordinator on a VM, start 'crossfed coordinator worker' "
            "near the store and name its URL (blobs.s3.merge_worker or --merge-worker)"
        )
    merger = RemoteMerger(url, admin_token, retry_budget_s=15.0)
    merger.health()
    return merger


def _worker_problem(coordinator: Any, merger: Any, state_dir: Path) -> str | None:
    """Why the merge worker cannot serve this run (None: it can): the run's fp32 master of
    its committed generation must be on the worker's disk, which it is not for a run that
    began without that worker."""
    from crossfed.coordinator.blobs import BlobError

    if merger is None or coordinator.spec is None:
        return None
    try:
        merger.shapes(coordinator.generation)
    except BlobError as exc:
        if exc.status != 404:
            raise
        return (
            f"the merge worker at {merger.url} does not hold this run's generation "
            f"{coordinator.generation} ({exc}); a run keeps its fp32 master where it began "
            f"({state_dir / 'models'} without a worker): start the coordinator as the run "
            "began, or a new run in a new state dir"
        )
    return None


def cmd_coordinator_worker(args: argparse.Namespace) -> int:
    """Serve a merge worker beside the object store (the coordinator's reads and writes of
    deltas and models, docs/objectstore.md)."""
    import uvicorn

    from crossfed.coordinator.app import Tokens
    from crossfed.coordinator.merger import LocalMerger
    from crossfed.coordinator.objectstore import ObjectStoreConfigError, open_object_store
    from crossfed.coordinator.worker import create_worker_app

    try:
        objects = open_object_store(args.blobs, Path(args.secrets))
        if objects is None:
            raise ObjectStoreConfigError(
                f"{args.blobs}: blobs.backend is file; a merge worker serves blobs.backend: s3"
            )
    except ObjectStoreConfigError as exc:
        print(f"crossfed coordinator worker: {exc}", file=sys.stderr)
        return 2
    merger = LocalMerger(Path(args.state_dir) / "models", objects)
    app = create_worker_app(merger, Tokens.load(Path(args.secrets)).admin)
    ssl = {}
    if args.ssl_certfile:
        ssl = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **ssl)
    return 0


def cmd_coordinator_start(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import start_embedded

    config = run_config(args)
    if config.coordinator.url != "embedded":
        print(f"coordinator is remote ({config.coordinator.url}); nothing to start")
        return 0
    url = start_embedded(config, list(load_sites(config)))
    print(f"crossfed coordinator listening on {url} (state: {config.coordinator.state_dir})")
    return 0


def cmd_coordinator_stop(args: argparse.Namespace) -> int:
    from crossfed.coordinator.embedded import stop_embedded

    config = run_config(args)
    if config.coordinator.url == "embedded" and stop_embedded(config):
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
    sites = list(dict.fromkeys(args.site or list(load_sites(run_config(args)))))
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


def _secure_model(config: RunConfig, client: Any, generation: int, out: Path) -> Path:
    """Keep a global model where the workflow cannot delete it, and link it to ``out``.

    The coordinator keeps only its last few generations, so the workflow's copy would be
    the only one left; Snakemake deletes a rule's outputs before it reruns the rule. The
    model is kept in ``<results>/.crossfed/models`` (no rule's output; a site loop that
    trained from it may have put it there already) and hard-linked to ``out``, so a rerun
    that deleted ``out`` finds it there again.
    """
    from crossfed.fileio import kept_model_path, link_or_copy

    kept = kept_model_path(Path(config.results), generation)
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
    from crossfed.client.http import Refused
    from crossfed.client.reach import client_for
    from crossfed.coordinator.runspec import run_spec

    config = run_config(args)
    client = client_for(config, "admin")
    if args.resume_only:
        try:
            client.status()
        except Refused as exc:
            if exc.code != "no_run":
                raise
            print("no run on the coordinator yet; the workflow's init_run job creates it")
            return 0
        if not (Path(config.data.dir) / "meta.json").exists():
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
    if args.out or not args.resume_only:  # the workflow's hook wants the one-line summary
        # the reply's spec (the run as the coordinator stores it, every unset setting
        # decided) wins over this config's; a coordinator without one leaves the config's
        write_json(args.out, {"spec": spec.to_dict(), **reply})
    return 0


def cmd_round_wait(args: argparse.Namespace) -> int:
    from crossfed.client.reach import client_for

    config = run_config(args)
    client = client_for(config, "admin")
    backoff, last = Backoff(0.2, 2.0, factor=1.5, budget_s=args.timeout_s or None), None
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
        if not backoff.wait():
            print(f"round {args.round} still open after {args.timeout_s}s", file=sys.stderr)
            return 3
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
    write_json(args.out, info)
    return 0


def _round_progress(config: RunConfig, info: dict[str, Any]) -> None:
    """The run-level progress line of a closed round: round k of N and the run's ETA."""
    from crossfed.progress import CONSOLE, closed_round_seconds, round_line

    results = Path(config.results)
    earlier = closed_round_seconds(results, before=info["round_no"])
    seconds = [*earlier, info["closed_at"] - info["opened_at"]]
    CONSOLE.info(round_line(info, config.rounds, seconds, time.time()))


def cmd_ledger(args: argparse.Namespace) -> int:
    import pandas as pd

    from crossfed.client.reach import EndpointError, client_for

    config = run_config(args)
    try:
        records = client_for(config, "admin").ledger()
    except EndpointError:  # the embedded coordinator has stopped: read its state directly
        from crossfed.coordinator.service import read_ledger

        records = read_ledger(Path(config.coordinator.state_dir))
    frame = pd.DataFrame(records)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
    if args.format == "csv":
        print(frame.to_csv(index=False), end="")
    else:
        print(frame.to_string(index=False))
    return 0


def _effective_config(args: argparse.Namespace) -> RunConfig:
    """The run config; with ``--config`` left at its default, the effective config the
    workflow wrote (``<results>/.crossfed/config.yaml``: the profile's and ``--config``
    overrides included) where it exists. ``--set`` applies on top either way."""
    config = run_config(args)
    if args.config in (None, DEFAULT_CONFIG):
        written = Path(config.results) / ".crossfed" / "config.yaml"
        if written.exists():
            return run_config(argparse.Namespace(**{**vars(args), "config": str(written)}))
    return config


def _admin_read(config: RunConfig, live: Any, stopped: Any) -> tuple[Any, bool]:
    """``live(client)`` from the running coordinator, else ``stopped(state_dir)`` from the
    state directory it left (an embedded coordinator that has stopped, or one out of reach
    whose state is on this machine). Returns the answer and whether it was live."""
    from crossfed.client.http import Unreachable
    from crossfed.client.reach import EndpointError, client_for
    from crossfed.coordinator.service import CoordinatorError

    state_dir = Path(config.coordinator.state_dir)
    quick = {"retry_budget_s": 3.0} if config.coordinator.url == "embedded" else {}
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
    from crossfed.progress import (
        closed_round_seconds,
        evaluations,
        ledger_line,
        progress_lines,
        run_progress,
    )

    config = _effective_config(args)
    status, live = _admin_read(config, lambda client: client.status(), read_status)
    results = Path(config.results)
    seconds = closed_round_seconds(results, before=status["round"])
    closes = [
        json.loads(p.read_text()).get("closed_at") or 0.0
        for p in results.glob("rounds/*/merge.json")
    ]
    open_since = max(closes) if live and closes else None
    progress = run_progress(
        status, config.rounds, seconds, evaluations(results), open_since, time.time()
    )
    if args.json:
        write_json(None, {**status, "live": live, "progress": progress})
        return 0
    state = config.coordinator.state_dir
    where = "coordinator live" if live else f"coordinator stopped; read from {state}"
    print(f"run {config.run_name} ({where})")
    for line in progress_lines(progress, live):
        print(line)
    print(ledger_line(status))
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
    summary = write_report(config, list(load_sites(config)), Path(config.results), ledger)
    from crossfed.progress import CONSOLE

    CONSOLE.info(
        "final held-out perplexity %.2f after %d rounds (%.2f at round 0), %s tokens from %s",
        summary["val_perplexity"],
        summary["rounds"],
        summary["initial_val_perplexity"],
        f"{summary['tokens']:,}",
        ", ".join(summary["sites"]),
    )
    print(f"metrics: {Path(config.results) / 'metrics' / 'final.json'}")
    return 0


def _site_name(text: str) -> str:
    if text == "admin" or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a site name (lower-case letter, then up to 31 of a-z 0-9 _ -; "
            "not 'admin')"
        )
    return text


def add_coordinator(sub: argparse._SubParsersAction) -> None:
    """Register ``coordinator serve|worker|start|stop|secrets`` on the crossfed parser."""
    csub = group(
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
        epilog=examples(
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
        type=positive_seconds,
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
        type=non_negative,
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
    serve.add_argument(
        "--blobs",
        metavar="YAML",
        help="keep deltas and global models where this file's 'blobs' section says (a run "
        "config, or the section alone): 'backend: s3' and its 's3' settings put them in an "
        "S3-compatible store (docs/objectstore.md); default: the state directory",
    )
    serve.add_argument(
        "--merge-worker",
        metavar="URL",
        help="hand the reads and writes of deltas and models to the merge worker at URL "
        "(crossfed coordinator worker, beside the object store); default: the blobs "
        "section's s3.merge_worker, else this process does them",
    )
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    serve.set_defaults(func=cmd_coordinator_serve)
    worker = csub.add_parser(
        "worker",
        help="serve a merge worker beside the object store (foreground)",
        description="Serve a merge worker: beside an S3-compatible store, it reads uploaded "
        "deltas back,\nmerges each round into the next generation and writes the global "
        "model to the store,\nso that no delta or model byte passes through the "
        "coordinator (docs/objectstore.md).",
        epilog=examples(
            "crossfed coordinator worker --state-dir worker --secrets secrets.yaml \\",
            "    --blobs config/config.yaml --host 0.0.0.0 --port 8471",
        ),
    )
    worker.add_argument(
        "--state-dir", required=True, help="the run's fp32 master and momentum live here"
    )
    worker.add_argument(
        "--secrets",
        required=True,
        help="the coordinator's secrets file: its 'admin' token is the only one accepted "
        "(and its 's3' mapping the store's key, unless AWS_ACCESS_KEY_ID is set)",
    )
    worker.add_argument(
        "--blobs",
        required=True,
        metavar="YAML",
        help="a file with the run's 'blobs' section (backend: s3 and its store)",
    )
    worker.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    worker.add_argument("--port", type=int, default=8471, help="TCP port to listen on")
    worker.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    worker.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    worker.set_defaults(func=cmd_coordinator_worker)
    for name, func, text in (
        ("start", cmd_coordinator_start, "start the embedded coordinator on loopback"),
        ("stop", cmd_coordinator_stop, "stop the embedded coordinator"),
    ):
        p = csub.add_parser(
            name,
            help=text,
            description=f"{text[:1].upper()}{text[1:]} (the workflow's onstart/onsuccess hooks do "
            "this); nothing to do when\nthe config's coordinator.url names a remote coordinator.",
            epilog=examples(f"crossfed coordinator {name} --config config/config.yaml"),
        )
        add_config(p)
        p.set_defaults(func=func)
    secrets = csub.add_parser(
        "secrets",
        help="write the secrets file: an admin token and one token per site",
        description="Write the coordinator's secrets file (mode 0600): a random admin token and "
        "one per site.\nAn existing file is extended: tokens it has are kept, sites it lacks get "
        "one. Without --site\nthe sites are the run config's (its sites_file).",
        epilog=examples(
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
    add_config(secrets)
    secrets.set_defaults(func=cmd_coordinator_secrets)


def add_run(sub: argparse._SubParsersAction) -> None:
    """Register ``run init`` on the crossfed parser."""
    rsub = group(
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
        epilog=examples(
            "CROSSFED_TOKEN=<admin token> crossfed run init --config config/config.yaml "
            "--out run.json",
            "crossfed run init --config config/config.yaml --resume-only",
        ),
    )
    add_config(init)
    init.add_argument("--out", help="write the run description and the reply (JSON) here")
    init.add_argument("--model-out", help="also download the initial model (generation 0)")
    init.add_argument(
        "--resume-only",
        action="store_true",
        help="only resume or extend a run the coordinator already has (more rounds lengthen "
        "its learning-rate schedule); do nothing if it has none",
    )
    init.set_defaults(func=cmd_run_init)


def add_round(sub: argparse._SubParsersAction) -> None:
    """Register ``round wait`` on the crossfed parser."""
    rdsub = group(
        sub, "round", "outer rounds",
        "crossfed round wait --config config/config.yaml --round 3 --timeout-s 3600",
    )  # fmt: skip
    wait = rdsub.add_parser(
        "wait",
        help="wait until the coordinator closes a round",
        description="Wait until the coordinator closes a round (every site in, or the "
        "stragglers' leases expired)\nand applies the outer step; print who contributed, and "
        "keep the new global model.",
        epilog=examples(
            "crossfed round wait --config config/config.yaml --round 3 \\",
            "    --model-out results/checkpoints/global-3.safetensors",
        ),
    )
    add_config(wait)
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


def add_views(sub: argparse._SubParsersAction) -> None:
    """Register ``ledger``, ``status`` and ``report`` on the crossfed parser."""
    ledger = sub.add_parser(
        "ledger",
        help="the DARL ledger (paper Table 3)",
        description="Print the DARL ledger: every lease, commit and expiry, from the running "
        "coordinator or,\nwhen it has stopped, from its state directory.",
        epilog=examples(
            "crossfed ledger --config config/config.yaml",
            "crossfed ledger --config config/config.yaml --format csv --out ledger.csv",
        ),
    )
    add_config(ledger)
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
        epilog=examples(
            "crossfed status --config config/config.yaml",
            "crossfed status --config config/config.yaml --json",
        ),
    )
    add_config(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)

    report = sub.add_parser(
        "report",
        help="final metrics, tables and plots",
        description="Write the run's final metrics (metrics/final.json), per-round and per-site "
        "tables and plots\nunder the config's results directory (the workflow's report rule).",
        epilog=examples("crossfed report --config results/.crossfed/config.yaml"),
    )
    add_config(report)
    report.set_defaults(func=cmd_report)
