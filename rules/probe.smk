# Stage 1: ask the schedulers when a job of each shape would start (`sbatch --test-only`).
# Once per round for the plan of that round, and before every chained Slurm job, whose
# probe also captures the trailing sacct history (the walltime discount gamma).


rule probe:
    input:
        previous=previous_round,
    output:
        probe=f"{RESULTS}/rounds/{{round}}/probe.csv",
    log:
        f"{LOGS}/probe/{{round}}.log",
    params:
        crossfed=CROSSFED,
        sites=RUN.sites_file,
        only=probe_only(),
        history=f"{RESULTS}/probes/history.csv",
        python=PYTHON,
        config=CONFIG,
    priority: ROUND_PRIORITY
    conda:
        CONDA_ENV
    shell:
        # a round the coordinator closed already is not probed: its probe table stays
        # empty (crossfed.catchup; a late site replays every earlier round)
        "{params.python} -m crossfed.catchup probe --config {params.config}"
        " --round {wildcards.round} --out {output.probe} > {log} 2>&1"
        " || {params.crossfed} --log {log} probe --sites {params.sites} {params.only}"
        " --out {output.probe} --history {params.history}"


rule probe_job:
    input:
        previous=previous_job,
    output:
        probe=f"{RESULTS}/sites/{{site}}/job-{{job}}/probe.csv",
        sacct=f"{RESULTS}/sites/{{site}}/job-{{job}}/sacct.txt",
    log:
        f"{LOGS}/probe/{{site}}-job{{job}}.log",
    params:
        crossfed=CROSSFED,
        sites=RUN.sites_file,
        only=" ".join(f"--site {s}" for s in SLURM_SITES),
        history=lambda wildcards: f"{RESULTS}/probes/history-{wildcards.site}.csv",
    priority: SITE_LOOP_PRIORITY  # it sizes the chain's next job
    conda:
        CONDA_ENV
    shell:
        # sacct may be unavailable (a warning, no history): the plan then uses gamma = 1
        "{params.crossfed} --log {log} probe --sites {params.sites} {params.only}"
        " --out {output.probe} --history {params.history} --sacct-out {output.sacct}"
        " && touch {output.sacct}"
