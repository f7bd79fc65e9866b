# Stage 3 of a round: the sites train H inner steps on leased blocks.
#
# Every site runs the same site loop (crossfed.site.loop): a long-lived job that trains the
# coordinator's current round and the ones after it back to back, taking each round's
# accumulation A from the newest plan (the barrier fill), and never replays a round the
# coordinator has closed, so a site that starts late trains the round that is open. The loop
# needs only the run (run.json), no round's probe, plan or merge, and it takes the first
# free core or job slot (SITE_LOOP_PRIORITY): a late site's jobs for the closed rounds record
# them alongside it, never ahead of it. A site without a batch scheduler runs one such job for the run (rule train). A Slurm site runs a
# chain of allocations (checkpoint train_job): each job has the planned shape and starts no
# round it could not finish before its walltime; the workflow then probes, plans and submits
# the next job, which carries on from whatever round is current by then. A job that dies
# (walltime, node failure, scancel, a crash) loses only its in-flight lease and is retried.
# Elastic: no rule needs every site's output. Both write one record per round trained
# (<results>/rounds/<r>/train/<site>.json) and, at the end, the chain-<last round>.json
# that names the run's length, so an extended run trains on.


rule train:
    input:
        run=f"{RESULTS}/run.json",
    output:
        end=f"{RESULTS}/sites/{{site}}/chain-{{last_round}}.json",
    log:
        f"{LOGS}/train/{{site}}-through-{{last_round}}.log",
    wildcard_constraints:
        site=alternatives(LOCAL_SITES),
        last_round=r"[1-9]\d*",
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    threads: 1
    priority: SITE_LOOP_PRIORITY
    retries: 2
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} site run --config {params.config} --site {wildcards.site}"
        " --through-round {wildcards.last_round} --until-walltime none"
        " --threads {threads} --out {output.end}"


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
    priority: SITE_LOOP_PRIORITY
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


TRAIN_TARGETS = expand(
    f"{RESULTS}/sites/{{site}}/chain-{{last_round}}.json", site=HERE, last_round=ROUNDS[-1]
)
