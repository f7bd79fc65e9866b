# Shared names: the validated config (defaults filled by workflow/schemas), the sites, the
# rounds, and the coordinator's lifecycle hooks. No training or ledger logic lives here.
import os
import yaml
from crossfed.config import load_sites, validate

config.update(validate(dict(config), "config.schema.yaml", "workflow config"))
RESULTS = config["results"]
DATA = config["data"]["dir"]
LOGS = f"{RESULTS}/logs"
SITES = list(load_sites(config))
ROUNDS = list(range(1, config["rounds"] + 1))
CROSSFED = "crossfed"

# the effective config (after --config overrides) for the CLI; rewritten only when it changes
CONFIG = f"{RESULTS}/.crossfed/config.yaml"
_resolved = yaml.safe_dump(dict(config), sort_keys=True)
if not os.path.exists(CONFIG) or open(CONFIG).read() != _resolved:
    os.makedirs(os.path.dirname(CONFIG), exist_ok=True)
    with open(CONFIG + ".tmp", "w") as _handle:
        _handle.write(_resolved)
    os.replace(CONFIG + ".tmp", CONFIG)


wildcard_constraints:
    round=r"\d+",
    site="|".join(SITES),


def previous_eval(wildcards):
    """A round starts from the checkpoint of the round before it (round 0 = initial model)."""
    return f"{RESULTS}/rounds/{int(wildcards.round) - 1}/eval.json"


onstart:
    shell(f"{CROSSFED} coordinator start --config {CONFIG}")


onsuccess:
    shell(f"{CROSSFED} coordinator stop --config {CONFIG}")
    print(f"crossfed: run finished; metrics in {RESULTS}/metrics/final.json, "
          "HTML report: snakemake --profile <profile> --report report.html")


onerror:
    shell(f"{CROSSFED} coordinator stop --config {CONFIG}")
