# Stage 3 of a round: the sites train H inner steps on leased blocks.
#
# A site without a batch scheduler runs one job per round (rule train). A Slurm site runs a
# chain of allocations (checkpoint train_job): each job has the planned shape, trains the
# coordinator's current round and the ones after it back to back, and starts no round it
# could not finish before its walltime; the workflow then probes, plans and submits the
# next job, which carries on from whatever round is current. A job Slurm kills (walltime,
# node failure, scancel) loses only its in-flight lease and is retried. Elastic: no rule
# needs every site's output.


rule train:
    input:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
        previous=previous_model,
    output:
        outcome=f"{RESULTS}/rounds/{{round}}/train/{{site}}.json",
    log:
        f"{LOGS}/train/{{site}}-{{round}}.log",
    wildcard_constraints:
        site=alternatives(LOCAL_SITES),
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    threads: 1
    retries: 2
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} site run --config {params.config} --site {wildcards.site}"
        " --round {wildcards.round} --plan {input.plan} --threads {threads}"
        " --out {output.outcome}"


checkpoint train_job:
    input:
        plan=rules.plan_job.output.plan,
        previous=previous_job,
    output:
        outcome=f"{RESULTS}/sites/{{site}}/job-{{job}}/outcome.json",
    log:
        f"{LOGS}/train/{{site}}-job{{job}}.log",
    wildcard_constraints:
        site=alternatives(SLURM_SITES),
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    threads: 1
    retries: 3
    resources:
        slurm_partition=lambda wildcards, input: job_shape(input, wildcards)["partition"],
        runtime=lambda wildcards, input: job_shape(input, wildcards)["runtime_min"],
        nodes=lambda wildcards, input: job_shape(input, wildcards)["nodes"],
        gpu=lambda wildcards, input: job_shape(input, wildcards)["gpus"] or None,
        # several nodes: the job step runs the command in the batch step (the plugin's
        # `mpi` pattern), where crossfed starts one torchrun per node with srun
        mpi=lambda wildcards, input: "srun" if job_shape(input, wildcards)["nodes"] > 1 else None,
        tasks=lambda wildcards, input: (
            job_shape(input, wildcards)["nodes"] if job_shape(input, wildcards)["nodes"] > 1
            else None
        ),
        tasks_per_gpu=lambda wildcards, input: (
            0 if job_shape(input, wildcards)["nodes"] > 1 else None
        ),
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} site run --config {params.config} --site {wildcards.site}"
        " --through-round run --until-walltime auto --plan {input.plan}"
        " --threads {threads} --out {output.outcome}"


# The chain's end is named after the run's last round: an extended run asks for a file
# that does not exist yet, so its chain goes on (under rerun-triggers: mtime, a job whose
# output exists is never rerun for an input its input function only now names).
rule chain_end:
    input:
        last=chain_last,
    output:
        end=f"{RESULTS}/sites/{{site}}/chain-{{last_round}}.json",
    log:
        f"{LOGS}/train/{{site}}-chain-{{last_round}}.log",
    wildcard_constraints:
        site=alternatives(SLURM_SITES),
        last_round=r"[1-9]\d*",
    conda:
        CONDA_ENV
    shell:
        "cp {input.last} {output.end} 2> {log}"


CHAIN_ENDS = expand(
    f"{RESULTS}/sites/{{site}}/chain-{{last_round}}.json", site=SLURM_SITES, last_round=ROUNDS[-1]
)
TRAIN_TARGETS = expand(
    f"{RESULTS}/rounds/{{round}}/train/{{site}}.json", round=ROUNDS, site=LOCAL_SITES
) + CHAIN_ENDS
