# Stage 5 of a round: evaluate the round's global model (versioned by generation) on the
# held-out windows. Under a Slurm profile this is a small batch job (one GPU, shared node).
# The wildcard is the generation (the round that made the model; 0 = the initial model).


rule evaluate:
    input:
        model=f"{RESULTS}/checkpoints/global-{{generation}}.safetensors",
    output:
        evaluation=f"{RESULTS}/rounds/{{generation}}/eval.json",
    log:
        f"{LOGS}/evaluate/{{generation}}.log",
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    threads: 1
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} evaluate --config {params.config}"
        " --generation {wildcards.generation} --model-out {input.model}"
        " --out {output.evaluation} --threads {threads}"
