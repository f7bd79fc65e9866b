# Stage 5 of a round: pull the new global model (versioned by generation) and evaluate it.


def merged(wildcards):
    if int(wildcards.round) == 0:
        return f"{RESULTS}/run.json"
    return f"{RESULTS}/rounds/{wildcards.round}/merge.json"


rule checkpoint:
    input:
        merged=merged,
    output:
        model=f"{RESULTS}/checkpoints/global-{{round}}.safetensors",
        evaluation=f"{RESULTS}/rounds/{{round}}/eval.json",
    log:
        f"{LOGS}/checkpoint/{{round}}.log",
    threads: 1
    shell:
        "{CROSSFED} --log {log} checkpoint --config {CONFIG} --generation {wildcards.round}"
        " --model-out {output.model} --out {output.evaluation} --threads {threads}"
