"""Benchmark: data preparation in one process vs. in N separate jobs over groups of shards.

Every stage runs the functions `crossfed data prepare` runs, each in a process of its own
(forked, so interpreter start-up is not timed), on the embedded corpus repeated --copies
times (or --input shards), with one tokenizer trained first, so only tokenisation and the
window store are timed. Each process is held to one core (``RAYON_NUM_THREADS=1`` and CPU
affinity), the way a job holds its allocation: the one-process run gives
``tokens_per_s_per_core``; the N-job runs (plan, N part processes at once, each on its own
core where there are enough, gather) give ``speedup`` = one-process seconds / N-job wall
seconds, and ``identical`` says whether every N-job store equals the one-process store byte
for byte (train.bin, val.bin, meta.json). With fewer cores than jobs, the parts share cores.
``gather_mb_per_s`` is the gather's copy-and-hash rate, timed on --gather-mb of tokens.
``hours_100b`` extrapolates 100e9 tokens from the measured per-core rate and gather rate
(N one-core jobs, linear in N: the parts share nothing; the tokenizer's training, at most
256 M characters whatever the corpus, is left out). Prints one JSON object last.

    .venv/bin/python bench/prepare.py                      # embedded corpus, 8 shards
    .venv/bin/python bench/prepare.py --jobs 1 2 4 8 --input /data/c4/en
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # one core per process, before tokenizers starts its pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from crossfed.data import scatter  # noqa: E402
from crossfed.data.corpus import (  # noqa: E402
    embedded_documents,
    iter_documents,
    resolve_inputs,
    write_shards,
)
from crossfed.data.prepare import prepare, request  # noqa: E402
from crossfed.data.tokenizer import train_tokenizer  # noqa: E402
from crossfed.data.windows import windows_from_token_files  # noqa: E402

FILES = ("train.bin", "val.bin", "meta.json")
TOKENS_100B = 100e9
_FORK = multiprocessing.get_context("fork")


def _digests(data_dir: Path) -> dict[str, str]:
    return {n: hashlib.sha256((data_dir / n).read_bytes()).hexdigest() for n in FILES}


def _pinned(core: int, work: Callable[[], object]) -> None:
    os.sched_setaffinity(0, {core})
    work()


def _timed(works: list[Callable[[], object]], cores: list[int]) -> float:
    """Wall seconds of ``works`` run at once, each in a forked process on one core."""
    procs = [
        _FORK.Process(target=_pinned, args=(cores[k % len(cores)], work))
        for k, work in enumerate(works)
    ]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    seconds = time.perf_counter() - started
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if failed:
        raise SystemExit(f"a preparation process failed (exit codes {failed})")
    return seconds


def _quiet(_: str) -> None:
    pass


def _gather_rate(root: Path, nbytes: int, seq_len: int) -> float:
    """Bytes per second the gather copies and hashes, on ``nbytes`` of uint16 tokens."""
    part = root / "part.bin"
    part.parent.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with open(part, "wb") as f:
        for _ in range(0, nbytes, 64 << 20):
            f.write(rng.integers(0, 4096, size=32 << 20, dtype=np.uint16).tobytes())
    cut = partial(windows_from_token_files, [part], root, seq_len=seq_len, vocab_size=4096,
                  eos=0, n_documents=1)  # fmt: skip
    seconds = min(_timed([cut], [0]) for _ in range(2))
    return part.stat().st_size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, action="append", help="C4 shards (default: embedded)")
    parser.add_argument("--copies", type=int, default=4, help="embedded corpus repeated")
    parser.add_argument("--shards", type=int, default=8, help="shards of the embedded corpus")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="quietest of this many runs")
    parser.add_argument("--gather-mb", type=int, default=512, help="tokens timed in the gather")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))

    with tempfile.TemporaryDirectory(prefix="crossfed-bench-prepare-") as tmp:
        root = Path(tmp)
        if args.input:
            sources = resolve_inputs(args.input)
        else:
            docs = embedded_documents() * args.copies
            sources = write_shards(docs, root / "corpus", args.shards)
        started = time.perf_counter()
        tok = train_tokenizer(iter_documents(sources), args.vocab_size, root / "tokenizer.json")
        tokenizer_s = time.perf_counter() - started
        settings = dict(inputs=sources, tokenizer=tok, seq_len=args.seq_len)

        serial_dir = root / "serial"

        def serial() -> None:
            prepare(serial_dir, force=True, log=_quiet, **settings)

        serial_s = min(_timed([serial], cores) for _ in range(args.repeats))
        meta = json.loads((serial_dir / "meta.json").read_text())
        want = _digests(serial_dir)

        runs: dict[str, dict] = {}
        for jobs in args.jobs:
            req = request(root / f"jobs-{jobs}", **settings)
            parts = [partial(scatter.part, req, k, jobs, _quiet) for k in range(jobs)]
            best: dict | None = None
            for _ in range(args.repeats):
                plan_s = _timed([partial(scatter.plan, req, jobs, _quiet)], cores)
                parts_s = _timed(parts, cores)
                gather_s = _timed([partial(scatter.gather, req, jobs, _quiet)], cores)
                wall = plan_s + parts_s + gather_s
                if best is None or wall < best["wall_s"]:
                    best = {"wall_s": wall, "plan_s": plan_s, "parts_s": parts_s,
                            "gather_s": gather_s}  # fmt: skip
            assert best is not None
            best["speedup"] = serial_s / best["wall_s"]
            best["identical"] = _digests(req.out_dir) == want
            runs[str(jobs)] = {k: round(v, 3) if isinstance(v, float) else v
                               for k, v in best.items()}  # fmt: skip
        gather_bytes_s = _gather_rate(root / "gather", args.gather_mb << 20, args.seq_len)

    n_tokens = meta["n_tokens"]
    itemsize = 2 if meta["dtype"] == "uint16" else 4
    per_core = n_tokens / serial_s
    gather_100b_h = TOKENS_100B * itemsize / gather_bytes_s / 3600
    hours = {
        str(n): round(TOKENS_100B / (per_core * n) / 3600 + gather_100b_h, 2)
        for n in (1, 16, 64, 256, 1024)
    }
    result = {
        "corpus": "inputs" if args.input else f"embedded x{args.copies} ({args.shards} shards)",
        "n_tokens": n_tokens,
        "vocab_size": meta["vocab_size"],
        "cores": len(cores),
        "tokenizer_train_s": round(tokenizer_s, 2),
        "serial_s": round(serial_s, 3),
        "tokens_per_s_per_core": round(per_core),
        "gather_mb_per_s": round(gather_bytes_s / 1e6, 1),
        "jobs": runs,
        "speedup": {n: r["speedup"] for n, r in runs.items()},
        "identical": all(r["identical"] for r in runs.values()),
        "hours_100b": hours,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
