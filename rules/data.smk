# Stage 0: the pre-tokenised corpus every site holds, and the run on the coordinator.


rule prepare_data:
    output:
        meta=protected(f"{DATA}/meta.json"),
    log:
        f"{LOGS}/prepare_data.log",
    params:
        config=CONFIG,
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        # the settings come from the config file, not params: a changed data setting is
        # refused when the workflow is read (crossfed.resume), never a rerun that deletes
        "{CROSSFED_JOB} --log {log} data prepare --config {params.config}"


rule init_run:
    input:
        meta=rules.prepare_data.output.meta,
    output:
        run=protected(f"{RESULTS}/run.json"),
        model=protected(f"{RESULTS}/checkpoints/global-0.safetensors"),
    log:
        f"{LOGS}/init_run.log",
    params:
        config=CONFIG,
    conda:
        CONDA_ENV
    shell:
        "{CROSSFED} --log {log} run init --config {params.config} --out {output.run}"
        " --model-out {output.model}"
