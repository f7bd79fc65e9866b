# Shared names: the validated config (defaults filled by workflow/schemas), the sites, the
# rounds, the input functions every stage uses, and the coordinator's lifecycle hooks.
# No training or ledger logic lives here; the rules call the `crossfed` CLI.
import json
import os
from pathlib import Path

import yaml
from crossfed.chain import planned_job
from crossfed.config import ConfigError, check_run, load_sites, validate

config.update(validate(dict(config), "config.schema.yaml", "workflow config"))
RESULTS = config["results"]
DATA = config["data"]["dir"]
LOGS = f"{RESULTS}/logs"
SITE_CONFIG = load_sites(config)
check_run(config, SITE_CONFIG)  # the model flavour; 'here' names sites of the run
SITES = list(SITE_CONFIG)
ROUNDS = list(range(1, config["rounds"] + 1))
CROSSFED = "crossfed"

# The sites whose jobs this workflow submits: every site of the run (local profile, one
# login node driving a test cluster), or only the site whose login node this is.
HERE = config["here"] or SITES
# A site without a batch scheduler runs one job per round; a Slurm site chains allocations.
LOCAL_SITES = [s for s in HERE if SITE_CONFIG[s]["scheduler"] != "slurm"]
SLURM_SITES = [s for s in HERE if SITE_CONFIG[s]["scheduler"] == "slurm"]

# How jobs find crossfed: an Apptainer image (LUMI, Frontier) or environment modules
# (Snellius), used under the profile's software-deployment-method; the conda environment
# documents the same software for `--sdm conda`.
CONTAINER = config["software"]["container"]
MODULES = config["software"]["modules"]
CONDA_ENV = "../workflow/envs/crossfed.yaml"

# the effective config (after --config overrides) for the CLI; rewritten only when it changes
CONFIG = f"{RESULTS}/.crossfed/config.yaml"
_resolved = yaml.safe_dump(dict(config), sort_keys=True)
if not os.path.exists(CONFIG) or open(CONFIG).read() != _resolved:
    os.makedirs(os.path.dirname(CONFIG), exist_ok=True)
    with open(f"{CONFIG}.tmp", "w") as _handle:
        _handle.write(_resolved)
    os.replace(f"{CONFIG}.tmp", CONFIG)


wildcard_constraints:
    round=r"\d+",
    job=r"[1-9]\d*",
    site="|".join(SITES),


# Quick bookkeeping and waiting run on the login node; training, evaluation and data
# preparation go to the batch system under a Slurm profile.
localrules:
    all,
    init_run,
    probe,
    plan,
    merge,
    report,
    probe_job,
    plan_job,
    chain_end,


def alternatives(names):
    """A wildcard regex matching exactly these names (and nothing when there are none)."""
    return "|".join(names) if names else "(?!)"


def previous_eval(wildcards):
    """A round starts from the checkpoint of the round before it (round 0 = initial model)."""
    return f"{RESULTS}/rounds/{int(wildcards.round) - 1}/eval.json"


def previous_round(wildcards):
    """Round r is planned once round r-1 has closed (evaluations run alongside)."""
    if int(wildcards.round) == 1:
        return f"{RESULTS}/run.json"
    return f"{RESULTS}/rounds/{int(wildcards.round) - 1}/merge.json"


def tokens_per_round():
    """H * seq_len * sum over sites of B*W*A: the tokens one outer round consumes."""
    windows = sum(
        s["micro_batch"] * s["ranks"] * s["accumulation"] for s in SITE_CONFIG.values()
    )
    return config["inner"]["steps"] * config["data"]["seq_len"] * windows


def probe_only():
    """`--site` flags limiting probes to the sites this workflow submits for."""
    return " ".join(f"--site {s}" for s in HERE) if config["here"] else ""


def previous_job(wildcards):
    """A chain job follows the one before it (the first follows the run's creation)."""
    job = int(wildcards.job)
    if job == 1:
        return f"{RESULTS}/run.json"
    return f"{RESULTS}/sites/{wildcards.site}/job-{job - 1}/outcome.json"


def rounds_done(wildcards, input):
    """Rounds the coordinator had closed when the previous job of the chain ended."""
    seen = json.loads(open(input.previous).read())
    current = seen.get("next_round") or seen.get("round") or 1
    return max(0, min(int(current) - 1, config["rounds"]))


def job_shape(input, wildcards):
    """The planned shape of a chain job (partition, nodes, GPUs, walltime)."""
    plan = json.loads(open(input.plan).read())
    return planned_job(plan, wildcards.site, SITE_CONFIG[wildcards.site])


def chain_last(wildcards):
    """The last job of a site's chain: the DAG grows one chain job at a time (checkpoints)."""
    for job in range(1, config["chain"]["max_jobs"] + 1):
        outcome = checkpoints.train_job.get(site=wildcards.site, job=job).output.outcome
        if not json.loads(open(outcome).read())["next_job"]:
            return outcome
    raise ConfigError(f"site {wildcards.site}: chain reached chain.max_jobs jobs")


onstart:
    shell(f"{CROSSFED} coordinator start --config {CONFIG}")


onsuccess:
    shell(f"{CROSSFED} coordinator stop --config {CONFIG}")
    print(f"crossfed: run finished; metrics in {RESULTS}/metrics/final.json, "
          "HTML report: snakemake --profile <profile> --report report.html")


onerror:
    shell(f"{CROSSFED} coordinator stop --config {CONFIG}")
