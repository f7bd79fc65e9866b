# Stage 4 of a round: the coordinator closes the round (everyone in, or stragglers' leases
# expired) and applies the outer step; this job waits for that, not for the sites' files,
# and secures the new global model at once (the coordinator keeps only the last few).


rule merge:
    input:
        plan=f"{RESULTS}/rounds/{{round}}/plan.json",
    output:
        # protected (write-protected; Snakemake refuses to delete them to redo a round, for
        # any user but root); the model also stays in results/.crossfed/models, no rule's
        # output, since the coordinator keeps only its last few generations
        merge=protected(f"{RESULTS}/rounds/{{round}}/merge.json"),
        model=protected(f"{RESULTS}/checkpoints/global-{{round}}.safetensors"),
    log:
        f"{LOGS}/merge/{{round}}.log",
    wildcard_constraints:
        round=r"[1-9]\d*",
    params:
        crossfed=CROSSFED,
        config=CONFIG,
    # it waits on the coordinator: no core of the workflow's is held while it does, so the
    # next round's probe, plan and evaluations keep pace with the site loops
    threads: 0
    priority: ROUND_PRIORITY
    conda:
        CONDA_ENV
    shell:
        "{params.crossfed} --log {log} round wait --config {params.config}"
        " --round {wildcards.round} --out {output.merge} --model-out {output.model}"
