# Stage 0: the pre-tokenised corpus every site holds, and the run on the coordinator.
#
# With data.prepare_jobs = N > 1 the corpus is tokenised in N separate jobs over groups of its
# shards: prepare_plan fixes the tokenizer and the groups, prepare_part tokenises one group,
# and prepare_data gathers the parts into the same bytes one job writes. The plan and the
# parts are temporary: once meta.json stands, no job count (a changed one included) makes
# Snakemake prepare the data again (the profiles rerun on mtime only).
PREPARE_JOBS = RUN.data.prepare_jobs
PREPARE_PLAN = f"{DATA}/.prepare/plan-of-{PREPARE_JOBS}.json"
PREPARE_PARTS = [
    f"{DATA}/.prepare/part-{k}-of-{PREPARE_JOBS}.{ext}"
    for k in range(PREPARE_JOBS)
    for ext in ("bin", "json")
]


rule prepare_plan:
    output:
        plan=temp(PREPARE_PLAN),
    log:
        f"{LOGS}/prepare_plan.log",
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} data prepare --config {params.config} --plan"


rule prepare_part:
    input:
        plan=PREPARE_PLAN,
    output:
        tokens=temp(f"{DATA}/.prepare/part-{{part}}-of-{PREPARE_JOBS}.bin"),
        record=temp(f"{DATA}/.prepare/part-{{part}}-of-{PREPARE_JOBS}.json"),
    log:
        f"{LOGS}/prepare_part/{{part}}-of-{PREPARE_JOBS}.log",
    wildcard_constraints:
        part=r"\d+",
    params:
        crossfed=CROSSFED_JOB,
        config=CONFIG,
    conda:
        CONDA_ENV
    container:
        CONTAINER
    envmodules:
        *MODULES,
    shell:
        "{params.crossfed} --log {log} data prepare --config {params.config} --part {wildcards.part}"


rule prepare_data:
    input:
        # one job (the default) prepares it all; more gather the parts
        parts=[PREPARE_PLAN, *PREPARE_PARTS] if PREPARE_JOBS > 1 else [],
    output:
        meta=protected(f"{DATA}/meta.json"),
    log:
        f"{LOGS}/prepare_data.log",
    params:
        crossfed=CROSSFED_JOB,
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
        "{params.crossfed} --log {log} data prepare --config {params.config}"


rule init_run:
    input:
        meta=rules.prepare_data.output.meta,
    output:
        run=protected(f"{RESULTS}/run.json"),
        model=protected(f"{RESULTS}/checkpoints/global-0.safetensors"),
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
