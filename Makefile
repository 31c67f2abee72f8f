# One command each: every target that needs Python first builds .venv from
# requirements.txt (once, and again when requirements.txt changes).
# `make test PYTHON=python3` uses an existing interpreter instead (no install).

PYTHON ?=
VENV   := .venv

ifeq ($(strip $(PYTHON)),)
PY    := $(VENV)/bin/python
SETUP := $(VENV)/.installed
else
PY    := $(PYTHON)
SETUP :=
endif

.PHONY: help setup test copy train clean

help:
	@echo "make test         create .venv, install, run the whole test suite"
	@echo "make copy         train the copy task with both attention forms (CPU, ~1 min)"
	@echo "make train        train de->en on Multi30k (preset gpu with CUDA, else cpu; PRESET=smoke|cpu|gpu,"
	@echo "                  NPROC=2 for torchrun, ARGS='--src en --tgt de' for more)"
	@echo "PYTHON=python3    use an existing interpreter instead of .venv"

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install -r requirements.txt
	touch $@

setup: $(SETUP)

test: $(SETUP)
	$(PY) -m pytest

copy: $(SETUP)
	$(PY) -m annotated.transformer

PRESET ?=
NPROC  ?= 1
ARGS   ?=
TRAIN_ARGS := $(if $(PRESET),--preset $(PRESET)) $(ARGS)

train: $(SETUP)
ifeq ($(NPROC),1)
	$(PY) train_wmt.py $(TRAIN_ARGS)
else
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train_wmt.py $(TRAIN_ARGS)
endif

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
