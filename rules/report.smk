# The end: final metrics, the DARL ledger (paper Table 3), per-round tables, the plans and
# probes behind the placement, the chained Slurm jobs, and plots (paper Figs. 1 and 2b).


rule report:
    input:
        evaluations=expand(f"{RESULTS}/rounds/{{round}}/eval.json", round=[0] + ROUNDS),
        merges=expand(f"{RESULTS}/rounds/{{round}}/merge.json", round=ROUNDS),
        chains=expand(f"{RESULTS}/sites/{{site}}/chain.json", site=SLURM_SITES),
    output:
        final=f"{RESULTS}/metrics/final.json",
        rounds=f"{RESULTS}/metrics/rounds.csv",
        sites=f"{RESULTS}/metrics/sites.csv",
        ledger=report(f"{RESULTS}/ledger.csv", caption="../workflow/report/ledger.rst",
                      category="Data leasing"),
        perplexity=report(f"{RESULTS}/plots/perplexity.png",
                          caption="../workflow/report/perplexity.rst", category="Training"),
        wallclock=report(f"{RESULTS}/plots/perplexity_wallclock.png",
                         caption="../workflow/report/perplexity_wallclock.rst",
                         category="Training"),
        round_time=report(f"{RESULTS}/plots/round_time.png",
                          caption="../workflow/report/round_time.rst", category="Overhead"),
        plans=report(f"{RESULTS}/metrics/plans.csv", caption="../workflow/report/plans.rst",
                     category="Placement"),
        probes=report(f"{RESULTS}/plots/probes.png", caption="../workflow/report/probes.rst",
                      category="Placement"),
        chains=report(f"{RESULTS}/metrics/chains.csv", caption="../workflow/report/chains.rst",
                      category="Placement"),
    log:
        f"{LOGS}/report.log",
    params:
        config=CONFIG,
    conda:
        CONDA_ENV
    shell:
        "{CROSSFED} --log {log} report --config {params.config}"
