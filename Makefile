# Two commands on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: venv demo test lint bench clean

$(PYTHON):
	"$$(tools/find_python.sh)" -m venv $(VENV)

# Re-install when the project's dependencies change.
$(STAMP): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/pagedjax fetch-demo
	$(VENV)/bin/pagedjax generate "$(PROMPT)"

test: venv
	$(VENV)/bin/pagedjax fetch-demo
	$(VENV)/bin/ruff check pagedjax pallas_kernels models tests bench tools
	$(VENV)/bin/python -m pytest -n 2 --timeout 1200 --ignore=tests/aot $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check pagedjax pallas_kernels models tests bench tools

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
