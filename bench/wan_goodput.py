"""Benchmark: goodput of the local three-site workflow behind a long, throttled link, one
stream against N.

``make run``'s workflow (the local profile, config/config.yaml and config/sites.yaml as
committed, overlapped rounds on) runs three times in fresh run directories, each against
its own standalone coordinator process (``crossfed coordinator serve``):

* ``local``: the sites reach the coordinator over loopback, as ``make run``'s do;
* ``wan_1`` and ``wan_n``: every site reaches it through the WAN emulator
  (``crossfed.testing.wan_emulator``, an emulator, not a network) over one link with
  Frontier's 347 ms round trip and a per-connection window of ``--window`` bytes (default
  128 KiB: about 0.38 MB/s per connection, so the tiny model's 2.6 MB delta and global model
  take seconds each on one stream, a real share of a phase), with ``transport.streams`` 1
  and ``--streams`` N; ``transport.stream_min_bytes`` is lowered to 64 KiB so the tiny
  model's transfers split at all (Qwen3-0.6B's 1.19 GB split under the default 16 MiB).

Every site's steps last at least ``--step-s`` seconds (default 1 s, ``min_step_s`` in the
sites file; the tiny model's own steps take a fraction of that here), so a phase of the
workflow's H=25 steps lasts 25 s on any machine and the three sites no longer race for this
machine's two cores: the 8-stream chain behind a fold-in (upload, merge, download) is then
about a fifth of a phase and the one-stream chain about two thirds, as for Qwen3-0.6B over
Frontier's link at the paper's H=100. ``--step-s 0`` runs the steps at this machine's pace
(phases of 5-20 s that follow its load: the figures before this setting).

Goodput is the report's (``final.json`` key ``goodput``): the sites' accepted compute
seconds over the wall seconds of their site jobs. The last line printed is one JSON object:
``goodput_local``, ``goodput_wan_1``, ``goodput_wan_n`` (target: ``goodput_wan_n`` >= 0.95
where ``goodput_wan_1`` falls below it), and per run the held-out perplexity, the mean wait
for a merged model and the workflow's seconds.

    .venv/bin/python bench/wan_goodput.py               # three workflows, about 15 minutes
    .venv/bin/python bench/wan_goodput.py --rounds 1 --variants wan_1 wan_n   # smoke
    .venv/bin/python bench/wan_goodput.py --variants wan_n --max-stale 0.5   # a later fold-in
    .venv/bin/python bench/wan_goodput.py --step-s 0    # steps at this machine's own pace
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap import committed_config, run_local_workflow  # noqa: E402  (sibling benchmarks)
from transport import start_coordinator  # noqa: E402

from crossfed.coordinator.embedded import ensure_secrets, free_port  # noqa: E402
from crossfed.testing import stop_process  # noqa: E402
from crossfed.testing.wan_emulator import PAPER_LINKS, EmulatorProcess, Link  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: the runs: over loopback, behind the link on one stream, behind it on N
VARIANTS = ("local", "wan_1", "wan_n")
#: seconds every site's step lasts at least: phases of H=25 steps last 25 s, so that the link's
#: chain behind a fold-in (upload, merge, download) is the share of a phase it is for
#: Qwen3-0.6B over Frontier's link at H=100 with the paper's step time (docs/wan.md)
STEP_S = 1.0


def paced_sites(step_s: float) -> dict:
    """The committed sites file with every site's steps lasting at least ``step_s`` seconds
    (``min_step_s``, above each site's own paced step here): every phase of H steps lasts
    the same seconds on any machine, and the three sites' steps no longer race for this
    machine's two cores, as a real site's own GPUs do not (0: the committed file, steps at
    this machine's pace)."""
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    if step_s > 0:
        for site in sites["sites"].values():
            site["min_step_s"] = step_s
    return sites


def run_workflow(
    root: Path,
    link: Link | None,
    streams: int,
    rounds: int | None,
    max_stale: float | None = None,
    step_s: float = 0.0,
) -> dict:
    """The local workflow in ``root`` against its own coordinator, through ``link`` (None:
    over loopback), with ``overlap.max_stale`` set where given and the sites' steps paced at
    ``step_s`` (``paced_sites``); its figures."""
    state = root / "coordinator"
    state.mkdir(parents=True)
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    ensure_secrets(state / "secrets.yaml", list(sites["sites"]))
    port = free_port("127.0.0.1")
    coordinator = start_coordinator(state, port)
    try:
        relay = (
            contextlib.nullcontext({})
            if link is None
            else EmulatorProcess([replace(link, target_port=port)])
        )
        with relay as ports:
            config = committed_config()
            config["coordinator"].update(
                url=f"http://127.0.0.1:{ports[link.name] if link else port}",
                state_dir=str(state),
                secrets=str(state / "secrets.yaml"),
            )
            config["transport"].update(streams=streams, stream_min_bytes=64 << 10)
            if rounds:
                config["rounds"] = rounds
            if max_stale is not None:
                config["overlap"]["max_stale"] = max_stale
            what = f"{streams} stream(s) through {link}"
            figures = run_local_workflow(
                root, config, what, env={"NO_PROXY": ""}, sites=paced_sites(step_s)
            )
    finally:
        stop_process(coordinator)
    keep = ("val_perplexity", "rounds", "merge_wait_s", "workflow_s")
    figures["goodput"] = round(figures["goodput"], 4)
    return {"streams": streams, **{key: figures[key] for key in ("goodput", *keep)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default: config.yaml's")
    parser.add_argument("--streams", type=int, default=8, help="N")
    parser.add_argument("--rtt-ms", type=float, default=PAPER_LINKS["frontier"])
    parser.add_argument("--window", type=int, default=128 << 10)
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="runs to make"
    )
    parser.add_argument(
        "--max-stale",
        type=float,
        default=None,
        help="overlap.max_stale for every run (default: config.yaml's): a later fold-in",
    )
    parser.add_argument(
        "--step-s",
        type=float,
        default=STEP_S,
        help="every site's steps last at least this many seconds (0: this machine's pace)",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="make the runs in this folder and keep them"
    )
    args = parser.parse_args()
    link = Link("wan", "127.0.0.1", 0, args.rtt_ms, args.window)
    plan = {"local": (None, 1), "wan_1": (link, 1), "wan_n": (link, args.streams)}
    runs = {}
    folder = (
        contextlib.nullcontext(str(args.keep))
        if args.keep
        else tempfile.TemporaryDirectory(prefix="crossfed-wan-goodput-")
    )
    with folder as tmp:
        for name in args.variants:
            via, streams = plan[name]
            runs[name] = run_workflow(
                Path(tmp) / name, via, streams, args.rounds, args.max_stale, args.step_s
            )
            print(json.dumps({name: runs[name]}), flush=True)
    print(
        json.dumps(
            {
                "bench": "wan_goodput",
                "rtt_ms": args.rtt_ms,
                "window_bytes": args.window,
                "streams_n": args.streams,
                "max_stale": args.max_stale,
                "step_s": args.step_s,
                **{f"goodput_{name}": runs.get(name, {}).get("goodput") for name in VARIANTS},
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
