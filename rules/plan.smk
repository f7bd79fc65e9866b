# Stage 2 of a round: choose which sites train, with which shape and accumulation.


rule plan:
    input:
        probe=rules.probe.output.probe,
    output:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
    log:
        f"{LOGS}/plan/{{round}}.log",
    shell:
        "{CROSSFED} --log {log} plan --sites {config[sites_file]} --probes {input.probe}"
        " --round {wildcards.round} --out {output.plan}"
