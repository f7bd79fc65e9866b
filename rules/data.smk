# Stage 0: the pre-tokenised corpus every site holds, and the run on the coordinator.


rule prepare_data:
    output:
        meta=f"{DATA}/meta.json",
    log:
        f"{LOGS}/prepare_data.log",
    params:
        crossfed=CROSSFED,
        out=lambda wildcards, output: os.path.dirname(output.meta),
        inputs=" ".join(f"--input {p}" for p in config["data"]["inputs"]),
        tokenizer=(
            f"--tokenizer {config['data']['tokenizer']}" if config["data"]["tokenizer"] else ""
        ),
        vocab_size=config["data"]["vocab_size"],
        seq_len=config["data"]["seq_len"],
        val_fraction=config["data"]["val_fraction"],
        shards=config["data"]["shards"],
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} data prepare --out {params.out} {params.inputs}"
        " {params.tokenizer} --vocab-size {params.vocab_size} --seq-len {params.seq_len}"
        " --val-fraction {params.val_fraction} --shards {params.shards}"


rule init_run:
    input:
        meta=rules.prepare_data.output.meta,
    output:
        run=f"{RESULTS}/run.json",
        model=f"{RESULTS}/checkpoints/global-0.safetensors",
    log:
        f"{LOGS}/init_run.log",
    params:
        crossfed=CROSSFED,
        config=CONFIG,
    conda:
        CONDA_ENV
    shell:
        "{params.crossfed} --log {log} run init --config {params.config} --out {output.run}"
        " --model-out {output.model}"
