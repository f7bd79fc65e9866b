# Shared names: the validated config (defaults filled by workflow/schemas; RUN, its typed
# tree), the sites, the rounds, the input functions every stage uses, and the coordinator's
# lifecycle hooks.
# No training or ledger logic lives here; the rules call the `crossfed` CLI.
import json
import os
import shlex
import sys
from pathlib import Path

import yaml
from crossfed.site.loop import chain_continues
from crossfed.site.slurm import planned_job
from crossfed.config import ConfigError, check_run, load_sites, validate_run_config
from crossfed.fileio import write_atomic
from crossfed.resume import check_rerun
from snakemake.settings.types import DeploymentMethod

# Snakemake's `config` stays the validated mapping (the effective config written for the
# CLI); the rules read the typed tree built once from it
_VALIDATED, RUN = validate_run_config(config, "workflow config")
config.update(_VALIDATED)
RESULTS = RUN.results
DATA = RUN.data.dir
LOGS = f"{RESULTS}/logs"
SITE_CONFIG = load_sites(RUN)
check_run(RUN, SITE_CONFIG)  # the model flavour; 'here' names sites of the run
SITES = list(SITE_CONFIG)
ROUNDS = list(range(1, RUN.rounds + 1))
# a rerun may add rounds; a change that would alter the finished ones is refused here
check_rerun(RUN, SITE_CONFIG)

# The sites whose jobs this workflow submits: every site of the run (local profile, one
# login node driving a test cluster), or only the site whose login node this is.
HERE = list(RUN.here) or SITES
# A site without a batch scheduler runs one site-loop job for the run; a Slurm site chains
# allocations, each running the same loop (rules/train.smk).
LOCAL_SITES = [s for s in HERE if SITE_CONFIG[s].scheduler != "slurm"]
SLURM_SITES = [s for s in HERE if SITE_CONFIG[s].scheduler == "slurm"]

# Which ready job takes a free core (or Slurm job slot) first. The site loop needs only
# the run (run.json), and it goes first, with the probe and plan that size a Slurm chain's
# job: a site that starts late also has a probe, plan, merge and evaluation ready for each
# round closed before it came, and the loop must not wait for a core behind them. A
# round's own bookkeeping comes next, then the evaluations (priority 0), which run alongside.
SITE_LOOP_PRIORITY = 10
ROUND_PRIORITY = 1

# How jobs find crossfed: an Apptainer image (LUMI, Frontier) or environment modules
# (Snellius), used under the profile's software-deployment-method; the conda environment
# documents the same software for `--sdm conda`.
CONTAINER = RUN.software.container
MODULES = list(RUN.software.modules)
CONDA_ENV = "../workflow/envs/crossfed.yaml"

# How the rules and hooks call crossfed, whatever PATH says (each rule takes it as a param,
# as `snakemake --lint` asks; a venv at another path does not make finished jobs look
# changed, since the profiles rerun jobs on file times only: rerun-triggers: mtime).
# On the host (hooks, login-node rules, Slurm jobs without a container, env-modules jobs,
# which load the modules first) it is the crossfed of the Python running Snakemake: a Slurm
# job re-runs `<that python> -m snakemake` from the shared filesystem, so the path holds on
# the compute node too. Inside a job's Apptainer image or conda environment it is that
# environment's own crossfed (the host's venv is not there, or has the wrong torch).
_DEPLOY = workflow.deployment_settings.deployment_method
_IN_CONDA = DeploymentMethod.CONDA in _DEPLOY
PYTHON_HOST = shlex.quote(sys.executable)
CROSSFED_HOST = f"{PYTHON_HOST} -m crossfed"  # the hooks: never deployed
PYTHON = "python" if _IN_CONDA else PYTHON_HOST  # rules without a container directive
CROSSFED = f"{PYTHON} -m crossfed"
# rules with `container: CONTAINER` (data preparation, training, evaluation)
CROSSFED_JOB = (
    "crossfed" if _IN_CONDA or (DeploymentMethod.APPTAINER in _DEPLOY and CONTAINER) else CROSSFED
)

# The effective config (after --config overrides) that the CLI reads. Only the onstart hook
# writes it, so only a real run's main process does: a dry run (-n), --lint, --report and
# the Slurm jobs' own parses of the workflow leave the file that running jobs read alone.
CONFIG = f"{RESULTS}/.crossfed/config.yaml"

# The jobs' terminal output is training progress (crossfed.progress: a line per logging
# interval and site, one per closed round with the run's ETA), warnings and errors; all the
# rest a job says is in its rule log (`--log`). CROSSFED_TERMINAL=all shows everything.
os.environ.setdefault("CROSSFED_TERMINAL", "progress")


def write_config():
    """Write the effective config to CONFIG (atomically, and only when it changed)."""
    resolved = yaml.safe_dump(dict(config), sort_keys=True)
    path = Path(CONFIG)
    if path.exists() and path.read_text() == resolved:
        return
    write_atomic(path, resolved)


wildcard_constraints:
    round=r"\d+",
    for_round=r"\d+",  # the plan's round
    generation=r"\d+",  # the evaluation's: the round that made the model
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


def previous_model(wildcards):
    """A round starts from the global model of the round before it (round 0 = initial model).

    Not from that model's evaluation: a site that joins late trains the coordinator's
    current round without first evaluating every older generation (evaluations run alongside).
    """
    return f"{RESULTS}/checkpoints/global-{int(wildcards.round) - 1}.safetensors"


def previous_round(wildcards):
    """Round r is planned once round r-1 has closed (evaluations run alongside)."""
    if int(wildcards.round) == 1:
        return f"{RESULTS}/run.json"
    return f"{RESULTS}/rounds/{int(wildcards.round) - 1}/merge.json"


def probe_only():
    """`--site` flags limiting probes to the sites this workflow submits for."""
    return " ".join(f"--site {s}" for s in HERE) if RUN.here else ""


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
    return max(0, int(current) - 1)


def job_shape(input, wildcards):
    """The planned shape of a chain job (partition, nodes, GPUs, walltime)."""
    plan = json.loads(open(input.plan).read())
    return planned_job(plan, wildcards.site, SITE_CONFIG[wildcards.site])


def chain_last(wildcards):
    """The last job of a site's chain through round `last_round`: the DAG grows one chain
    job at a time (checkpoints).

    A chain that completed a shorter run goes on when the run has been extended.
    """
    for job in range(1, RUN.chain.max_jobs + 1):
        outcome = checkpoints.train_job.get(site=wildcards.site, job=job).output.outcome
        if not chain_continues(json.loads(open(outcome).read()), int(wildcards.last_round)):
            return outcome
    raise ConfigError(f"site {wildcards.site}: chain reached chain.max_jobs jobs")


onstart:
    write_config()
    shell(f"{CROSSFED_HOST} coordinator start --config {CONFIG}")
    # a run extended with more rounds: the coordinator lengthens its LR schedule
    shell(f"{CROSSFED_HOST} run init --config {CONFIG} --resume-only")


onsuccess:
    shell(f"{CROSSFED_HOST} coordinator stop --config {CONFIG}")
    print(f"crossfed: run finished; metrics in {RESULTS}/metrics/final.json, "
          "HTML report: snakemake --profile <profile> --report report.html")


onerror:
    shell(f"{CROSSFED_HOST} coordinator stop --config {CONFIG}")
