"""Data preparation as separate jobs: any number of jobs writes the one-process store's bytes.

The scattered path (plan, one `crossfed data prepare --part I` process per group of shards,
gather) is compared byte for byte with `crossfed data prepare` in one process: train.bin,
val.bin, meta.json and tokenizer.json, for 1, 2 and 4 jobs. Then what goes wrong between the
stages (a part missing or damaged, settings or tokenizer changed after the plan) is refused
with a message naming the file, and the number of jobs is shown to be no setting of the data:
the rerun guard accepts a changed count, and the local-profile workflow neither prepares the
data again nor changes a byte when the count changes.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crossfed.config import load_run_config
from crossfed.data import prepare as prepare_mod
from crossfed.data import scatter
from crossfed.data.corpus import embedded_documents, write_embedded_corpus
from crossfed.data.prepare import PrepareError, prepare, request
from crossfed.data.tokenizer import train_tokenizer
from crossfed.data.windows import WindowStore
from crossfed.resume import data_changes

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STORE_FILES = ("train.bin", "val.bin", "meta.json", "tokenizer.json")
SMALL = dict(vocab_size=300, seq_len=16, val_fraction=0.05)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five C4 shards of uneven sizes in three formats."""
    root = tmp_path_factory.mktemp("c4")
    texts = [d.text for d in embedded_documents(max_documents=100)]
    cuts = [0, 10, 35, 50, 80, 100]
    for k in range(5):
        lines = "".join(
            json.dumps({"text": t, "url": f"u{k}"}) + "\n" for t in texts[cuts[k] : cuts[k + 1]]
        )
        name = f"c4-train.{k:05d}-of-00005"
        if k % 3 == 0:
            (root / f"{name}.jsonl").write_text(lines, encoding="utf-8")
        elif k % 3 == 1:
            (root / f"{name}.json.gz").write_bytes(gzip.compress(lines.encode(), mtime=0))
        else:
            (root / f"{name}.json").write_text(lines, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def serial(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process store of ``corpus``."""
    out = tmp_path_factory.mktemp("serial")
    prepare(out, inputs=[corpus], log=lambda _: None, **SMALL)
    return out


def digests(data_dir: Path) -> dict[str, str]:
    return {n: hashlib.sha256((data_dir / n).read_bytes()).hexdigest() for n in STORE_FILES}


def config_file(path: Path, data_dir: Path, **data: object) -> Path:
    settings = {"dir": str(data_dir), **SMALL, **data}
    path.write_text(yaml.safe_dump({"data": settings}))
    return path


def crossfed(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "crossfed", "data", "prepare", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def stages(req_dir: Path, jobs: int, inputs: list[Path], **kw: object) -> dict:
    """Plan, parts and gather in this process (the same functions the CLI stages call)."""
    req = request(req_dir, inputs=inputs, **{**SMALL, **kw})
    scatter.plan(req, jobs, lambda _: None)
    for k in range(jobs):
        scatter.part(req, k, jobs, lambda _: None)
    return scatter.gather(req, jobs, lambda _: None)


@pytest.mark.parametrize("jobs", [1, 2, 4])
def test_separate_jobs_write_the_serial_bytes(
    tmp_path: Path, corpus: Path, serial: Path, jobs: int
) -> None:
    out = tmp_path / "data"
    cfg = config_file(tmp_path / "config.yaml", out, inputs=[str(corpus)], prepare_jobs=jobs)
    printed = finished(crossfed("--config", str(cfg), "--plan"))
    assert f"plan: 5 shard(s) in {jobs} part(s)" in printed
    parts = [crossfed("--config", str(cfg), "--part", str(k)) for k in range(jobs)]  # at once
    for k, proc in enumerate(parts):
        assert f"part {k} of {jobs}:" in finished(proc)
    gather = ["--gather"] if jobs == 1 else []  # with jobs > 1 the plain command gathers
    assert "gather:" in finished(crossfed("--config", str(cfg), *gather))

    assert digests(out) == digests(serial)
    assert sorted(p.name for p in out.iterdir()) == sorted(STORE_FILES)  # parts removed
    meta = json.loads((out / "meta.json").read_text())
    assert "prepare_jobs" not in json.dumps(meta) and "jobs" not in meta["params"]
    WindowStore.open(out).verify()
    WindowStore.open(out, "val").verify()


def test_embedded_corpus_and_given_tokenizer(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = functools.partial(write_embedded_corpus, max_documents=60)
    monkeypatch.setattr(prepare_mod, "write_embedded_corpus", small)
    prepare(tmp_path / "serial", inputs=None, shards=3, log=lambda _: None, **SMALL)
    stages(tmp_path / "jobs", 3, [], shards=3)
    assert digests(tmp_path / "jobs") == digests(tmp_path / "serial")
    assert (tmp_path / "jobs" / "corpus").is_dir()

    texts = [d.text for d in embedded_documents(max_documents=30)]
    tok = train_tokenizer(texts, 320, tmp_path / "given.json")
    prepare(tmp_path / "s2", inputs=[corpus], tokenizer=tok, log=lambda _: None, **SMALL)
    stages(tmp_path / "j2", 2, [corpus], tokenizer=tok)
    assert digests(tmp_path / "j2") == digests(tmp_path / "s2")
    assert (tmp_path / "j2" / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_more_jobs_than_shards_is_refused_before_any_work(tmp_path: Path, corpus: Path) -> None:
    req = request(tmp_path / "data", inputs=[corpus], **SMALL)
    with pytest.raises(PrepareError, match="6 preparation jobs for 5 shard.*at most 5"):
        scatter.plan(req, 6, lambda _: None)
    assert not (tmp_path / "data").exists()
    with pytest.raises(PrepareError, match="at least 1"):
        scatter.groups(5, 0)
    assert scatter.groups(5, 2) == [(0, 2), (2, 5)]


def test_a_missing_or_damaged_part_is_named_and_keeps_the_others(
    tmp_path: Path, corpus: Path
) -> None:
    out = tmp_path / "data"
    req = request(out, inputs=[corpus], **SMALL)
    scatter.plan(req, 3, lambda _: None)
    scatter.part(req, 0, 3, lambda _: None)
    scatter.part(req, 2, 3, lambda _: None)
    with pytest.raises(PrepareError, match=r"part-1-of-3\.json: record of part 1 not found"):
        scatter.gather(req, 3, lambda _: None)
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
    assert scatter.part_paths(out, 0, 3)[0].exists()  # the finished parts are kept

    scatter.part(req, 1, 3, lambda _: None)
    tokens = scatter.part_paths(out, 2, 3)[0]
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(PrepareError, match=r"part-2-of-3\.bin: missing or not the \d+ uint16"):
        scatter.gather(req, 3, lambda _: None)
    with pytest.raises(PrepareError, match="part 3 of a plan of 3 parts: give 0 to 2"):
        scatter.part(req, 3, 3, lambda _: None)

    scatter.part(req, 2, 3, lambda _: None)  # redone, the gather goes through
    assert scatter.gather(req, 3, lambda _: None)["n_documents"] == 100


def test_settings_or_tokenizer_changed_after_the_plan_are_refused(
    tmp_path: Path, corpus: Path
) -> None:
    out = tmp_path / "data"
    req = request(out, inputs=[corpus], **SMALL)
    scatter.plan(req, 2, lambda _: None)
    other = request(out, inputs=[corpus], **{**SMALL, "seq_len": 32})
    with pytest.raises(PrepareError, match="planned for other data settings"):
        scatter.part(other, 0, 2, lambda _: None)
    fewer = request(out, inputs=sorted(corpus.iterdir())[:3], **SMALL)
    with pytest.raises(PrepareError, match="planned for other input shards"):
        scatter.part(fewer, 0, 2, lambda _: None)
    with pytest.raises(PrepareError, match=r"plan-of-3\.json: preparation plan not found"):
        scatter.part(req, 0, 3, lambda _: None)
    scatter.part(req, 0, 2, lambda _: None)
    tok = out / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|endoftext|>" '))
    with pytest.raises(PrepareError, match="not the tokenizer the plan fixed"):
        scatter.gather(req, 2, lambda _: None)
    assert not (out / "meta.json").exists()


def test_the_job_count_is_no_setting_of_the_data(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "data"
    stages(out, 2, [corpus])
    data = {"dir": str(out), "inputs": [str(corpus)], **SMALL, "shards": 4}
    for jobs in (1, 2, 5):
        assert data_changes(load_run_config(None, {"data": {**data, "prepare_jobs": jobs}})) == []
    assert data_changes(load_run_config(None, {"data": {**data, "seq_len": 32}}))
    # a plain `crossfed data prepare` (one job) finds the store up to date
    log: list[str] = []
    prepare(out, inputs=[corpus], log=log.append, **SMALL)
    assert "up to date" in log[0]


def test_cli_refuses_a_bad_job_count(tmp_path: Path, corpus: Path) -> None:
    proc = crossfed("--out", str(tmp_path / "d"), "--input", str(corpus), "--jobs", "0")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "--jobs must be at least 1, got 0" in out
    proc = crossfed("--out", str(tmp_path / "d"), "--input", str(corpus), "--jobs", "2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "plan-of-2.json: preparation plan not found" in out


# --------------------------------------------------------------------------- the workflow


def _workflow_dir(root: Path, corpus: Path, jobs: int) -> Path:
    (root / "config").mkdir(parents=True)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["data"].update(inputs=[str(corpus)], prepare_jobs=jobs, **SMALL)
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "config" / "sites.yaml").write_text((REPO / "config" / "sites.yaml").read_text())
    return root


def _set_jobs(root: Path, jobs: int) -> None:
    path = root / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["data"]["prepare_jobs"] = jobs
    path.write_text(yaml.safe_dump(config))


def _snakemake(cwd: Path, *extra: str) -> str:
    """Snakemake on the local profile, making only the data (results/data/meta.json)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile",
           str(REPO / "profiles" / "local"), "--cores", "2",
           "results/data/meta.json", *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_workflow_local_profile_two_jobs_equal_one(
    tmp_path: Path, corpus: Path, serial: Path
) -> None:
    one = _workflow_dir(tmp_path / "one", corpus, 1)
    two = _workflow_dir(tmp_path / "two", corpus, 2)
    _snakemake(one)
    _snakemake(two)
    data_one, data_two = one / "results" / "data", two / "results" / "data"
    assert digests(data_one) == digests(data_two) == digests(serial)
    logs = two / "results" / "logs"
    assert (logs / "prepare_plan.log").is_file()
    for k in range(2):
        assert f"part {k} of 2:" in (logs / "prepare_part" / f"{k}-of-2.log").read_text()
    assert "gather: 2 part(s)" in (logs / "prepare_data.log").read_text()
    assert not (data_two / ".prepare").exists()
    assert not (one / "results" / "logs" / "prepare_plan.log").exists()  # one job, as before

    # a finished run's data stay as they are whatever the count becomes
    stamps = {p.name: p.stat().st_mtime_ns for p in data_two.iterdir()}
    before = digests(data_two)
    for jobs in (4, 1):
        _set_jobs(two, jobs)
        dry = _snakemake(two, "-n")
        assert "Nothing to be done" in dry, dry[-3000:]
        assert "Nothing to be done" in _snakemake(two)
    assert digests(data_two) == before
    assert {p.name: p.stat().st_mtime_ns for p in data_two.iterdir()} == stamps
