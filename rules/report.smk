# The end: final metrics, the DARL ledger (paper Table 3), per-round tables and plots.


rule report:
    input:
        evaluations=expand(f"{RESULTS}/rounds/{{round}}/eval.json", round=[0] + ROUNDS),
        merges=expand(f"{RESULTS}/rounds/{{round}}/merge.json", round=ROUNDS),
    output:
        final=f"{RESULTS}/metrics/final.json",
        rounds=f"{RESULTS}/metrics/rounds.csv",
        sites=f"{RESULTS}/metrics/sites.csv",
        ledger=report(f"{RESULTS}/ledger.csv", caption="../workflow/report/ledger.rst",
                      category="Data leasing"),
        perplexity=report(f"{RESULTS}/plots/perplexity.png",
                          caption="../workflow/report/perplexity.rst", category="Training"),
        round_time=report(f"{RESULTS}/plots/round_time.png",
                          caption="../workflow/report/round_time.rst", category="Overhead"),
    log:
        f"{LOGS}/report.log",
    shell:
        "{CROSSFED} --log {log} report --config {CONFIG}"
