# tunix_mcjax developer commands. `make setup` builds .venv with Python 3.12 and the pinned deps.
PYTHON312 := $(shell tools/python312)
VENV := .venv
PY := $(VENV)/bin/python
HOSTS ?= 2
DEVICES ?= 2

.PHONY: setup demo test test-all lint lock clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 is required (see tools/python312)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q -c constraints.txt -e '.[maxtext]' && $(PY) -m tunix_mcjax.patches apply maxtext
	touch $@

demo: $(VENV)/.installed
	$(PY) -m tunix_mcjax.launch --hosts $(HOSTS) --devices-per-host $(DEVICES) recipes/cpu/demo.yml

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m ""

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

lock: $(VENV)/.installed
	( echo "# Full pins for the dev venv (make setup). Regenerate with: make lock"; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt

clean:
	rm -rf $(VENV) *.egg-info runs
