# Stage 2 of a round: choose which sites train, with which shape and accumulation.
# Work is counted in outer rounds (one data unit = the tokens of one round); rounds already
# done are not replanned.


def tokens_per_round():
    """H * seq_len * sum over sites of B*W*A: the tokens one outer round consumes."""
    sites = load_sites(config)
    windows = sum(s["micro_batch"] * s["ranks"] * s["accumulation"] for s in sites.values())
    return config["inner"]["steps"] * config["data"]["seq_len"] * windows


rule plan:
    input:
        probe=rules.probe.output.probe,
    output:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
    log:
        f"{LOGS}/plan/{{round}}.log",
    params:
        done=lambda wildcards: int(wildcards.round) - 1,
        tokens_per_unit=tokens_per_round(),
        job_log=lambda wildcards: f"{RESULTS}/rounds/{wildcards.round}/job_log.csv",
    shell:
        # measured rounds -> the planner's job log; the plan's accumulation then fills the
        # barrier from measured step times (crossfed.train.barrier, paper Fig. 2a)
        "python -m crossfed.train.barrier job-log --results {RESULTS} --before {wildcards.round}"
        " --sites {config[sites_file]} --out {params.job_log} > {log} 2>&1"
        " && {CROSSFED} --log {log} plan --sites {config[sites_file]} --probes {input.probe}"
        " --target-units {config[rounds]} --units-per-round 1 --round {params.done}"
        " --tokens-per-unit {params.tokens_per_unit} --job-log {params.job_log}"
        " --out {output.plan}"
        " && python -m crossfed.train.barrier fill --plan {output.plan}"
        " --job-log {params.job_log} --sites {config[sites_file]} >> {log} 2>&1"
