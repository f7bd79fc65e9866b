# crossfed: `make run` sets up and trains the local embedded profile; `make test` runs the tests.
PYTHON ?= python3
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.crossfed-installed

.PHONY: run test setup system-deps lint docs bench clean

# pip's output (and any build warnings) goes to $(INSTALL_LOG); a failure prints its tail
INSTALL_LOG := $(VENV)/install.log
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

$(STAMP): pyproject.toml
	@echo "crossfed: installing into $(VENV) (log: $(INSTALL_LOG))"
	@$(PYTHON) -m venv $(VENV)
	@: > $(INSTALL_LOG)
	@# CPU build from local disk on this kind of machine; GPU sites install their own torch first
	@$(PIP) --upgrade pip >> $(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); exit 1; }
	@$(PIP) torch==2.13.0 >> $(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); exit 1; }
	@$(PIP) -e '.[test,docs]' >> $(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); exit 1; }
	@touch $(STAMP)

setup: $(STAMP)

# The terminal of `make run`: crossfed's progress lines (the profile quiets Snakemake's job
# banners; the scheduler's "Select jobs"/"Execute N jobs" and "Write-protecting" lines are
# filtered here). Every job's full output is in results/logs/, Snakemake's in .snakemake/log/.
SCHEDULER_LINES := ^((Select jobs to execute|Execute [0-9]+ jobs)\.\.\.|Write-protecting output file .*)$$
REPORT_LOG := results/logs/report-html.log

run: setup
	@set -o pipefail; PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake --profile profiles/local 2>&1 \
		| { grep --line-buffered -v -E '$(SCHEDULER_LINES)' || true; }
	@PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake --profile profiles/local \
		--report results/report.html > $(REPORT_LOG) 2>&1 || { cat $(REPORT_LOG); exit 1; }
	@echo "crossfed: report at results/report.html, metrics at results/metrics/final.json"

system-deps:
	bash scripts/install-system-deps.sh

# The docs site (mkdocs.yml) into site/; --strict: a broken link or anchor fails the build
# (no --quiet: it would hide the warnings that strict counts).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Lint, the docs build, unit tests on two workers (pytest-xdist; a file's tests stay on one
# worker), then the e2e tests on two workers too: the Slurm tests (which mostly wait on job
# walltimes) in turn on one, the others (whole workflows, the soak, Chromium) file by file
# beside them (tests/e2e/conftest.py: work_unit).
test: setup system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ruff check crossfed tests bench scripts
	$(MKDOCS)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q -n 2 --dist loadfile tests/unit \
		--timeout 1800 --durations=30
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q -n 2 tests/e2e --timeout 1800 --durations=30

lint: setup
	$(BIN)/ruff check crossfed tests bench scripts
	$(BIN)/snakemake --lint

# docs/config-reference.md from workflow/schemas/, then the site
docs: setup
	$(BIN)/python scripts/config_reference.py
	$(MKDOCS)

clean:
	rm -rf results .snakemake
