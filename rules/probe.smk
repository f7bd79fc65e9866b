# Stage 1 of a round: ask every site's scheduler when a job of each shape would start.


rule probe:
    input:
        previous=previous_eval,
    output:
        probe=f"{RESULTS}/rounds/{{round}}/probe.csv",
    log:
        f"{LOGS}/probe/{{round}}.log",
    shell:
        "{CROSSFED} --log {log} probe --sites {config[sites_file]} --out {output.probe}"
        " --history {RESULTS}/probes/history.csv"
