# tunix_mcjax developer commands. `make setup` builds .venv with Python 3.12 and the pinned deps.
PYTHON312 := $(shell tools/python312)
VENV := .venv
PY := $(VENV)/bin/python
HOSTS ?= 2
DEVICES ?= 2

.PHONY: setup demo test test-all lint lock clean

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

demo: $(VENV)/.patched
	$(PY) -m tunix_mcjax.launch --hosts $(HOSTS) --devices-per-host $(DEVICES) recipes/cpu/demo.yml

test: $(VENV)/.patched
	$(PY) -m pytest -q

test-all: $(VENV)/.patched
	$(PY) -m pytest -q -m ""

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

lock: $(VENV)/.installed
	( echo "# Full pins for the dev venv (make setup). Regenerate with: make lock"; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt

clean:
	rm -rf $(VENV) *.egg-info runs
