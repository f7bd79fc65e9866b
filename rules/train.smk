# Stage 3 of a round: one job per site trains H inner steps on leased blocks. Elastic: no
# rule needs every site's output; a killed job retries and rejoins (or finds it missed the round).


rule train:
    input:
        plan=rules.plan.output.plan,
        previous=previous_eval,
    output:
        outcome=f"{RESULTS}/rounds/{{round}}/train/{{site}}.json",
    log:
        f"{LOGS}/train/{{site}}-{{round}}.log",
    threads: 1
    retries: 2
    shell:
        "{CROSSFED} --log {log} site run --config {CONFIG} --site {wildcards.site}"
        " --round {wildcards.round} --plan {input.plan} --threads {threads} --out {output.outcome}"
