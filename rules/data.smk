# Stage 0: the pre-tokenised corpus every site holds, and the run on the coordinator.


rule prepare_data:
    output:
        meta=f"{DATA}/meta.json",
    log:
        f"{LOGS}/prepare_data.log",
    params:
        inputs=" ".join(f"--input {p}" for p in config["data"]["inputs"]),
        tokenizer=(
            f"--tokenizer {config['data']['tokenizer']}" if config["data"]["tokenizer"] else ""
        ),
    shell:
        "{CROSSFED} --log {log} data prepare --out {DATA} {params.inputs} {params.tokenizer}"
        " --vocab-size {config[data][vocab_size]} --seq-len {config[data][seq_len]}"
        " --val-fraction {config[data][val_fraction]} --shards {config[data][shards]}"


rule init_run:
    input:
        meta=rules.prepare_data.output.meta,
    output:
        run=f"{RESULTS}/run.json",
    log:
        f"{LOGS}/init_run.log",
    shell:
        "{CROSSFED} --log {log} run init --config {CONFIG} --out {output.run}"
