# Stage 2: choose which sites train, with which shape and accumulation (the waterfill).
# Work is counted in outer rounds (one data unit = the tokens of one round); rounds already
# done are not replanned.


rule plan:
    input:
        probe=rules.probe.output.probe,
    output:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
    log:
        f"{LOGS}/plan/{{round}}.log",
    params:
        crossfed=CROSSFED,
        sites=config["sites_file"],
        rounds=config["rounds"],
        done=lambda wildcards: int(wildcards.round) - 1,
        tokens_per_unit=tokens_per_round(),
        job_log=lambda wildcards: f"{RESULTS}/rounds/{wildcards.round}/job_log.csv",
        results=lambda wildcards, output: Path(output.plan).parents[2],
    conda:
        CONDA_ENV
    shell:
        # measured rounds -> the planner's job log; the plan's accumulation then fills the
        # barrier from measured step times (crossfed.train.barrier, paper Fig. 2a)
        "python -m crossfed.train.barrier job-log --results {params.results}"
        " --before {wildcards.round}"
        " --sites {params.sites} --out {params.job_log} > {log} 2>&1"
        " && {params.crossfed} --log {log} plan --sites {params.sites} --probes {input.probe}"
        " --target-units {params.rounds} --units-per-round 1 --round {params.done}"
        " --tokens-per-unit {params.tokens_per_unit} --job-log {params.job_log}"
        " --out {output.plan}"
        " && python -m crossfed.train.barrier fill --plan {output.plan}"
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
        crossfed=CROSSFED,
        sites=config["sites_file"],
        rounds=config["rounds"],
        done=rounds_done,
        tokens_per_unit=tokens_per_round(),
    conda:
        CONDA_ENV
    shell:
        "{params.crossfed} --log {log} plan --sites {params.sites} --probes {input.probe}"
        " --sacct-history {input.sacct} --target-units {params.rounds} --units-per-round 1"
        " --round {params.done} --tokens-per-unit {params.tokens_per_unit} --out {output.plan}"
