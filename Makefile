# Two commands set everything up on a fresh machine:
#   make train   trains a small GPT-2 on the embedded corpus
#   make test    runs the whole suite (8 fake CPU devices)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test train bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[train,test,notebook]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -q tests

train: $(STAMP)
	$(VENV)/bin/named-train --config_path config/gpt2_nano.yaml

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
