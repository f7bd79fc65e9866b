# crossfed: one LLM pre-training run pooled across several Slurm sites.
# Rounds read like a table of contents: probe -> plan -> train (one job per site) -> merge
# -> evaluate, then a final report. Every rule calls the `crossfed` CLI.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/probe.smk"
include: "rules/plan.smk"
include: "rules/train.smk"
include: "rules/merge.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    input:
        final=f"{RESULTS}/metrics/final.json",
        train=TRAIN_TARGETS,
