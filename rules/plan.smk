# Stage 2: choose which sites train, with which shape and accumulation (the waterfill).
# Work is counted in outer rounds (one data unit = the tokens of one round); rounds already
# done are not replanned. The run's length comes from the config file, not from params, so
# a rerun with more rounds adds jobs and leaves every finished plan as it is.


rule plan:
    input:
        probe=rules.probe.output.probe,
    output:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
    log:
        f"{LOGS}/plan/{{round}}.log",
    params:
        config=CONFIG,
        sites=config["sites_file"],
        done=lambda wildcards: int(wildcards.round) - 1,
        job_log=lambda wildcards: f"{RESULTS}/rounds/{wildcards.round}/job_log.csv",
        results=lambda wildcards, output: Path(output.plan).parents[2],
    conda:
        CONDA_ENV
    shell:
        # measured rounds -> the planner's job log; the plan's accumulation then fills the
        # barrier from measured step times (crossfed.train.barrier, paper Fig. 2a)
        "{PYTHON} -m crossfed.train.barrier job-log --results {params.results}"
        " --before {wildcards.round}"
        " --sites {params.sites} --out {params.job_log} > {log} 2>&1"
        " && {CROSSFED} --log {log} plan --config {params.config}"
        " --probes {input.probe} --round {params.done} --job-log {params.job_log}"
        " --out {output.plan}"
        " && {PYTHON} -m crossfed.train.barrier fill --plan {output.plan}"
        " --job-log {params.job_log} --sites {params.sites} >> {log} 2>&1"


rule plan_job:
    input:
        probe=rules.probe_job.output.probe,
        sacct=rules.probe_job.output.sacct,
        previous=previous_job,
    output:
        plan=f"{RESULTS}/sites/{{site}}/job-{{job}}/plan.json",
    log:
        f"{LOGS}/plan/{{site}}-job{{job}}.log",
    params:
        config=CONFIG,
        done=rounds_done,
    conda:
        CONDA_ENV
    shell:
        "{CROSSFED} --log {log} plan --config {params.config} --probes {input.probe}"
        " --sacct-history {input.sacct} --round {params.done} --out {output.plan}"
