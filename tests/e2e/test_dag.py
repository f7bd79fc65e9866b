"""`snakemake --dag` names every round's jobs (each label unique, its round or generation in it,
edges joining the same round), each site's one site-loop job names the run's last round, and
`--rulegraph` still shows the stages by rule name alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

BIN = Path(sys.executable).parent
ROUNDS = 3
PER_ROUND = {"probe": "round", "plan": "for_round", "merge": "round"}


def graph(tmp_path: Path, kind: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Nodes (id -> label) and edges of ``snakemake --<kind>`` on the local profile."""
    results = tmp_path / "results"
    done = subprocess.run(
        [
            BIN / "snakemake", "--profile", "profiles/local", f"--{kind}", "--config",
            f"results={results}", f"rounds={ROUNDS}", f'data={{"dir": "{results}/data"}}',
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert not results.exists()  # a graph writes nothing
    nodes = dict(re.findall(r'^\s*(\d+)\[label = "([^"]*)"', done.stdout, flags=re.M))
    edges = re.findall(r"^\s*(\d+) -> (\d+)", done.stdout, flags=re.M)
    return nodes, edges


def fields(label: str) -> tuple[str, dict[str, str]]:
    rule, *wildcards = label.split("\\n")
    return rule, dict(w.split(": ", 1) for w in wildcards)


def test_every_round_job_is_labelled_with_its_round(tmp_path: Path) -> None:
    nodes, edges = graph(tmp_path, "dag")
    labels = list(nodes.values())
    assert len(labels) == len(set(labels)), "two jobs with one label"
    jobs = {node: fields(label) for node, label in nodes.items()}
    sites = list(yaml.safe_load((REPO / "config" / "sites.yaml").read_text())["sites"])
    rounds = [str(r) for r in range(1, ROUNDS + 1)]
    seen: dict[str, list] = {}
    for rule, wildcards in jobs.values():
        seen.setdefault(rule, []).append(wildcards)
    for rule, name in PER_ROUND.items():
        numbers = sorted(w[name] for w in seen[rule])
        assert numbers == rounds, rule
    # one site loop per site trains every round: it is named after the run's last round
    assert sorted(w["site"] for w in seen["train"]) == sorted(sites)
    assert {w["last_round"] for w in seen["train"]} == {str(ROUNDS)}
    assert sorted(w["generation"] for w in seen["evaluate"]) == ["0", *rounds]

    def number(node: str) -> int:
        rule, wildcards = jobs[node]
        return int(wildcards[PER_ROUND.get(rule, "generation")])

    joined = 0
    for source, target in edges:  # Snakemake draws input job -> job that reads it
        (a, _), (b, _) = jobs[source], jobs[target]
        if a in PER_ROUND and b in PER_ROUND or (a, b) == ("merge", "evaluate"):
            step = 1 if (a, b) == ("merge", "probe") else 0
            assert number(target) == number(source) + step, (nodes[source], nodes[target])
            joined += 1
    assert joined >= 4 * ROUNDS - 1  # probe -> plan -> merge -> evaluate, merge -> next probe
    into_train = {jobs[a][0] for a, b in edges if jobs[b][0] == "train"}
    out_of_train = {jobs[b][0] for a, b in edges if jobs[a][0] == "train"}
    assert into_train == {"init_run"}, into_train
    assert out_of_train <= {"report", "all"}, out_of_train


def test_the_rule_graph_shows_the_stages_by_name(tmp_path: Path) -> None:
    nodes, edges = graph(tmp_path, "rulegraph")
    assert sorted(nodes.values()) == sorted(
        ["all", "report", "evaluate", "init_run", "prepare_data", "merge", "plan", "probe",
         "train"]
    )  # fmt: skip
    named = {(nodes[a], nodes[b]) for a, b in edges}
    for stage in [("probe", "plan"), ("init_run", "train"), ("train", "report"),
                  ("plan", "merge"), ("merge", "probe"), ("merge", "evaluate"),
                  ("evaluate", "report")]:  # fmt: skip
        assert stage in named
