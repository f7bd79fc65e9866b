# The end: final metrics, the DARL ledger (paper Table 3), per-round tables, the plans and
# probes behind the placement, the chained Slurm jobs, and plots (paper Figs. 1 and 2b).
# Tables go into `--report` as HTML pages (Snakemake offers CSVs only as downloads); the
# CSVs stay beside them.


rule report:
    input:
        evaluations=expand(f"{RESULTS}/rounds/{{round}}/eval.json", round=[0] + ROUNDS),
        merges=expand(f"{RESULTS}/rounds/{{round}}/merge.json", round=ROUNDS),
        chains=TRAIN_TARGETS,
    output:
        final=f"{RESULTS}/metrics/final.json",
        rounds=f"{RESULTS}/metrics/rounds.csv",
        sites=f"{RESULTS}/metrics/sites.csv",
        ledger=f"{RESULTS}/ledger.csv",
        ledger_page=report(f"{RESULTS}/report/ledger.html",
                           caption="../workflow/report/ledger.rst", category="Data leasing"),
        rounds_page=report(f"{RESULTS}/report/rounds.html",
                           caption="../workflow/report/rounds.rst", category="Overhead"),
        sites_page=report(f"{RESULTS}/report/sites.html",
                          caption="../workflow/report/sites.rst", category="Training"),
        perplexity=report(f"{RESULTS}/plots/perplexity.png",
                          caption="../workflow/report/perplexity.rst", category="Training"),
        wallclock=report(f"{RESULTS}/plots/perplexity_wallclock.png",
                         caption="../workflow/report/perplexity_wallclock.rst",
                         category="Training"),
        round_time=report(f"{RESULTS}/plots/round_time.png",
                          caption="../workflow/report/round_time.rst", category="Overhead"),
        goodput=report(f"{RESULTS}/plots/goodput.png",
                       caption="../workflow/report/goodput.rst", category="Overhead"),
        plans=f"{RESULTS}/metrics/plans.csv",
        plans_page=report(f"{RESULTS}/report/plans.html",
                          caption="../workflow/report/plans.rst", category="Placement"),
        probes=report(f"{RESULTS}/plots/probes.png", caption="../workflow/report/probes.rst",
                      category="Placement"),
        chains=f"{RESULTS}/metrics/chains.csv",
        chains_page=report(f"{RESULTS}/report/chains.html",
                           caption="../workflow/report/chains.rst", category="Placement"),
    log:
        f"{LOGS}/report.log",
    params:
        crossfed=CROSSFED,
        config=CONFIG,
    conda:
        CONDA_ENV
    shell:
        "{params.crossfed} --log {log} report --config {params.config}"
