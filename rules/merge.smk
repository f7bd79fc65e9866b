# Stage 4 of a round: the coordinator closes the round (everyone in, or stragglers' leases
# expired) and applies the outer step; this job waits for that, not for the sites' files.


rule merge:
    input:
        plan=rules.plan.output.plan,
    output:
        merge=f"{RESULTS}/rounds/{{round}}/merge.json",
    log:
        f"{LOGS}/merge/{{round}}.log",
    shell:
        "{CROSSFED} --log {log} round wait --config {CONFIG} --round {wildcards.round}"
        " --out {output.merge}"
