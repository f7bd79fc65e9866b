# Stage 5 of a round: evaluate the round's global model (versioned by generation) on the
# held-out windows. Under a Slurm profile this is a small batch job (one GPU, shared node).


rule checkpoint:
    input:
        model=f"{RESULTS}/checkpoints/global-{{round}}.safetensors",
    output:
        evaluation=f"{RESULTS}/rounds/{{round}}/eval.json",
    log:
        f"{LOGS}/checkpoint/{{round}}.log",
    params:
        config=CONFIG,
    threads: 1
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{CROSSFED_JOB} --log {log} checkpoint --config {params.config}"
        " --generation {wildcards.round} --model-out {input.model}"
        " --out {output.evaluation} --threads {threads}"
