# Stage 2: choose which sites train, with which shape and accumulation (the waterfill).
# The round is the wildcard `for_round` here (`round` in probe, train and merge, `generation`
# in evaluate): `snakemake --dag` labels a job with the wildcards its inputs' jobs lack, so
# each stage names the round under its own word and every round's jobs carry their number.
# Work is counted in outer rounds (one data unit = the tokens of one round); rounds already
# done are not replanned. The run's length comes from the config file, not from params, so
# a rerun with more rounds adds jobs and leaves every finished plan as it is.


rule plan:
    input:
        probe=f"{RESULTS}/rounds/{{for_round}}/probe.csv",
    output:
        plan=f"{RESULTS}/rounds/{{for_round}}/plan.json",
    log:
        f"{LOGS}/plan/{{for_round}}.log",
    params:
        crossfed=CROSSFED,
        python=PYTHON,
        config=CONFIG,
        sites=RUN.sites_file,
        done=lambda wildcards: int(wildcards.for_round) - 1,
        job_log=lambda wildcards: f"{RESULTS}/rounds/{wildcards.for_round}/job_log.csv",
        # the planner's plan before the fill: the site loops read plan.json as soon as it
        # exists, so it appears only once filled
        draft=lambda wildcards: f"{RESULTS}/rounds/{wildcards.for_round}/.plan-draft.json",
        results=lambda wildcards, output: Path(output.plan).parents[2],
    priority: ROUND_PRIORITY
    conda:
        CONDA_ENV
    shell:
        # a round the coordinator closed before this site planned it (a site that starts
        # late replays every earlier round): one process and one request write a plan
        # record saying so (crossfed.catchup). An open round: measured rounds -> the
        # planner's job log; the plan's accumulation then fills the barrier from measured
        # step times (crossfed.sched.barrier, paper Fig. 2a); every site loop, local or
        # Slurm, takes its A for the round from it (crossfed.site.loop.planned_accumulation)
        "{params.python} -m crossfed.catchup plan --config {params.config}"
        " --round {wildcards.for_round} --out {output.plan} > {log} 2>&1"
        " || ({params.crossfed} --log {log} plan job-log --results {params.results}"
        " --before {wildcards.for_round} --sites {params.sites} --out {params.job_log}"
        " && {params.crossfed} --log {log} plan --config {params.config}"
        " --probes {input.probe} --round {params.done} --job-log {params.job_log}"
        " --out {params.draft}"
        " && {params.crossfed} --log {log} plan fill --plan {params.draft}"
        " --out {output.plan} --job-log {params.job_log} --sites {params.sites}"
        " && rm -f {params.draft})"


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
        config=CONFIG,
        done=rounds_done,
    priority: SITE_LOOP_PRIORITY  # the chain's next job's shape
    conda:
        CONDA_ENV
    shell:
        "{params.crossfed} --log {log} plan --config {params.config} --probes {input.probe}"
        " --sacct-history {input.sacct} --round {params.done} --out {output.plan}"
