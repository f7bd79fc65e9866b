# crossfed: `make run` sets up and trains the local embedded profile; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.crossfed-installed

.PHONY: run test setup system-deps lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU build from local disk on this kind of machine; GPU sites install their own torch first
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake --profile profiles/local
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake --profile profiles/local --report results/report.html
	@echo "crossfed: report at results/report.html, metrics at results/metrics/final.json"

system-deps:
	bash scripts/install-system-deps.sh

test: setup system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ruff check crossfed tests bench
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q --timeout 1800 --durations=30

lint: setup
	$(BIN)/ruff check crossfed tests bench
	$(BIN)/snakemake --lint

clean:
	rm -rf results .snakemake
