# One command each: every target that needs Python first builds .venv from
# requirements.lock (once, and again when the lock changes): every package pinned with its hashes, the install
# the README's figures and the shipped models came from. requirements.txt is the human list; `make lock`
# resolves it into requirements.lock again. `make test PYTHON=python3` uses an existing interpreter (no install).

PYTHON ?=
VENV   := .venv

ifeq ($(strip $(PYTHON)),)
PY    := $(VENV)/bin/python
SETUP := $(VENV)/.installed
else
PY    := $(PYTHON)
SETUP :=
endif
# RUN: a command run by its target. ANNOTATED_MAKE=<target> tells the command so: a refusal then writes its fix as
# the make line to type (`make circuits ARGS=--force`, not `add --force`; annotated/door.py).
RUN    = ANNOTATED_MAKE=$@ $(PY)

.PHONY: help setup lock test test-arith lint format copy train clean equivalence

help:
	@echo "make test         create .venv, install requirements.lock, run the whole test suite"
	@echo "make test-arith   the float-sensitive tests again under other kernels (ATen's AVX2 and scalar"
	@echo "                  code, MKL's AVX2 and SSE paths), so a test that holds only on this CPU's"
	@echo "                  kernels fails here (CI runs it after make test; about 2 min)"
	@echo "make lint         ruff check, ruff format --check (nothing rewritten) and mypy on annotated/, benchmarks/,"
	@echo "                  docs/ and train_wmt.py (settings in pyproject.toml); CI runs it before the tests"
	@echo "make format       ruff format: rewrites the files in the house style (pyproject.toml [tool.ruff.format])"
	@echo "make lock         resolve requirements.txt into requirements.lock (pinned, with hashes)"
	@echo "make copy         train the copy task with both attention forms (CPU, about 1.5 min)"
	@echo "make train        train de->en on Multi30k (preset gpu with CUDA, else cpu; PRESET=smoke|cpu|gpu,"
	@echo "                  NPROC=2 for torchrun, ARGS='--src en --tgt de' for more)"
	@echo "make equivalence  prove per-head and fused attention are one function: sympy block algebra for"
	@echo "                  every size, integer tracers through the real code, the whole function bit for"
	@echo "                  bit where exact, generated cases, nn.MultiheadAttention, whole models"
	@echo "                  (CPU, ~1 min; CHECKPOINT=path.pt also checks a trained checkpoint)"
	@echo "make translate    TEXT='Ein Hund rennt.' [CHECKPOINT=...]; no TEXT: one sentence a line on stdin;"
	@echo "                  without a run, the shipped model (ARGS='--src en --tgt de' for en->de)"
	@echo "make attention    dump, draw and browse the attention of the latest run [CHECKPOINT=...]"
	@echo "make heads        what each head does: importance, ablation, inspection [CHECKPOINT=...];"
	@echo "                  ARGS='--prune' also removes heads (pruned.pt) and measures BLEU and speed"
	@echo "make circuits     every head's QK and OV circuits read from its weights, the cross-attention as a"
	@echo "                  dictionary and an aligner (eflomal): circuits.json, .html, pictures [CHECKPOINT=...]"
	@echo "make export       [CHECKPOINT=...] OUT=dir: the checkpoint as a transformers MarianMTModel folder"
	@echo "make import       HF=dir OUT=file.pt: a MarianMTModel folder (save_pretrained) as our checkpoint"
	@echo "make docs         the annotated source as a page: docs/_build/index.html (offline)"
	@echo "make screenshots  retake the README's screenshots (docs/screenshots/*.png) from the shipped de->en model"
	@echo "make notebook     annotated/transformer.py as an executed notebook, examples and figures inline:"
	@echo "                  docs/_build/transformer.ipynb (minutes: it trains the copy model, 400 steps, in a"
	@echo "                  Jupyter kernel; longer on a busy machine; says how to open it)"
	@echo "make jupyter      install JupyterLab into .venv (requirements-notebook.txt) and open the notebook"
	@echo "make bench        speed, memory and share of the CPU's peak, against torch.nn.Transformer [ARGS='--quick']"
	@echo "make gpu-report   every GPU figure in one command: bench, gpu preset de<->en, DDP (CUDA only, < 27 min)"
	@echo "make help         this list"
	@echo "PYTHON=python3    use an existing interpreter instead of .venv"

$(VENV)/.installed: requirements.lock
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --require-hashes -r requirements.lock
	touch $@

# make lock: requirements.txt resolved into requirements.lock (pip-tools, in a venv of its own, .lockenv);
# with hashes of every wheel of each pinned release, so the lock installs on other platforms too.
PIP_TOOLS := pip-tools==7.6.2
lock:
	test -x .lockenv/bin/pip-compile || (python3 -m venv .lockenv && .lockenv/bin/pip install -q $(PIP_TOOLS))
	.lockenv/bin/pip-compile --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	    --no-emit-find-links --quiet -o requirements.lock requirements.txt

setup: $(SETUP)

test: $(SETUP)
	$(PY) -m pytest

# make test-arith: the tests whose numbers depend on the arithmetic (the proof, the circuits, the two beam loops,
# the model's forms and caches, the Marian conversion, pruning) run again under each of ARITH_KERNELS, so a
# bit-equality that holds on this CPU's kernels only fails here, not on someone else's CPU. ATEN_CPU_CAPABILITY
# picks PyTorch's own vectorised kernels (avx2 where the CPU has AVX-512; default: no vector code);
# MKL_CBWR=AVX2 the BLAS's AVX2 path; MKL_ENABLE_INSTRUCTIONS=SSE4_2 its SSE path, whose float32 matrix-vector
# products also depend on where a matrix starts in memory. Left out (ARITH_SKIP): what checks learning,
# statistics, files or exact integers rather than rounding.
ARITH_TESTS := tests/proof tests/circuits/test_circuits.py tests/circuits/test_direct.py tests/decoding/test_search.py \
    tests/decoding/test_fast_search.py tests/decoding/test_option_matrix.py tests/interop/test_marian.py tests/test_transformer.py tests/test_sites.py \
    tests/test_recording.py tests/attention/test_prune.py annotated/transformer.py
ARITH_SKIP := copy_task_learns_to_copy or scaling_keeps_score_variance or test_command_writes or block_algebra \
    or tracers_follow or tracers_catch
ARITH_KERNELS := ATEN_CPU_CAPABILITY=avx2,MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=default,MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-arith: $(SETUP)
	@set -e; for kernels in $(ARITH_KERNELS); do \
	    echo "make test-arith: $$kernels" | tr , ' '; \
	    env $$(echo $$kernels | tr , ' ') $(PY) -m pytest -q -k 'not ($(ARITH_SKIP))' $(ARITH_TESTS); \
	done

# make lint: the linter, the formatter's check and the type checker, all configured in pyproject.toml; nothing is
# rewritten (`ruff format --check` fails on a file `make format` would change, and names it).
# make format: the formatter, which rewrites files.
lint: $(SETUP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(SETUP)
	$(PY) -m ruff format .

copy: $(SETUP)
	$(PY) -m annotated.transformer

PRESET ?=
NPROC  ?= 1
ARGS   ?=
TRAIN_ARGS := $(if $(PRESET),--preset $(PRESET)) $(ARGS)

train: $(SETUP)
ifeq ($(NPROC),1)
	$(RUN) train_wmt.py $(TRAIN_ARGS)
else
	$(RUN) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train_wmt.py $(TRAIN_ARGS)
endif

clean:
	rm -rf $(VENV) .lockenv .pytest_cache .hypothesis

# make translate TEXT="Ein Hund rennt über die Wiese."   (no TEXT: reads stdin, one sentence a line)
# CHECKPOINT=runs/<run>/best.pt or shipped:en-de (default: the latest run's model, runs/latest/averaged.pt or best.pt;
# with no run, the model shipped in annotated/shipped/ for ARGS='--src .. --tgt ..', default de -> en);
# ARGS="--beam 1" etc. for more (python -m annotated.decoding.translate --help).
# TEXT and CHECKPOINT reach the command exactly as typed: `$(call quoted,NAME)` is the variable's unexpanded
# value in single quotes (so `$5`, `$HOME`, spaces and `;` stay text), each ' written as '\''.
CHECKPOINT ?=
TEXT       ?=
quoted = '$(subst ','\'',$(value $(1)))'
.PHONY: translate
translate: $(SETUP)
	$(RUN) -m annotated.decoding.translate $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT)) $(ARGS) $(if $(value TEXT),$(call quoted,TEXT))

# make equivalence [CHECKPOINT=runs/<run>/best.pt]: the proof suite of annotated/proof/equivalence.py;
# exits non-zero if any check fails.
equivalence: $(SETUP)
	$(RUN) -m annotated.proof.equivalence $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT))

# `make bench`: training-step and decoding speed against torch.nn.Transformer, and the step as a share of the CPU's peak
# (benchmarks/bench.py; ARGS='--sizes cpu --quick' etc.); writes benchmarks/results/<device>-<date>.json.
.PHONY: bench
bench: $(SETUP)
	$(RUN) -m benchmarks.bench $(ARGS)

# `make gpu-report`: bench on CUDA (bf16, eager and compiled), the gpu preset de->en and en->de, a 2-GPU DDP
# smoke run; writes benchmarks/results/<device>-<date>.json and prints the table (benchmarks/gpu_report.py).
.PHONY: gpu-report
gpu-report: $(SETUP)
	$(RUN) -m benchmarks.gpu_report $(ARGS)

# make export [CHECKPOINT=shipped:de-en|runs/<run>/averaged.pt] OUT=exported [ARGS=--overwrite] (no CHECKPOINT: the
# latest run's model, else the shipped de -> en one); make import HF=folder OUT=model.pt [ARGS='--attention per_head
# --src de --tgt en']: annotated/interop/folders.py (over marian.py), to and from transformers' MarianMTModel.
.PHONY: export import
HF ?=
OUT ?=
export: $(SETUP)
	$(RUN) -m annotated.interop.folders export $(call quoted,CHECKPOINT) $(call quoted,OUT) $(ARGS)

import: $(SETUP)
	$(RUN) -m annotated.interop.folders import $(call quoted,HF) $(call quoted,OUT) $(ARGS)

# make attention [CHECKPOINT=runs/<run>/best.pt] [ARGS='--n 5' or ARGS='"Ein Hund rennt."']: dump, draw and
# browse every attention weight (annotated/attention/dump.py); default: best.pt of the latest run, first 3 test
# sentences; writes attention/ next to the checkpoint (index.json, sentence_*.npz, *.png, viewer.html).
.PHONY: attention
attention: $(SETUP)
	$(RUN) -m annotated.attention.dump $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT)) $(ARGS)

# make heads [CHECKPOINT=runs/<run>/best.pt] [ARGS='--prune --max-loss-increase 0.02 --sentences 300']: per head,
# importance, validation BLEU and loss without it, and its attention by relative position (python -m
# annotated.attention.heads --help); writes heads.json and pictures beside the checkpoint (--out elsewhere).
.PHONY: heads
heads: $(SETUP)
	$(RUN) -m annotated.attention.heads $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT)) $(ARGS)

# make circuits [CHECKPOINT=shipped:en-de] [ARGS='--head cross:1:2 --no-aligner']: every head's circuits
# (annotated/circuits/, Part V; python -m annotated.circuits.command --help); writes circuits.json, circuits.html
# and pictures beside the checkpoint (--out elsewhere); docs/circuits.md says how to read them.
.PHONY: circuits
circuits: $(SETUP)
	$(RUN) -m annotated.circuits.command $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT)) $(ARGS)

# make docs: annotated/*.py rendered into docs/_build/index.html (math as MathML, figures drawn by the
# modules' own code; offline). Attention figure from CHECKPOINT=..., else the latest run's model (averaged.pt or
# best.pt), else the shipped de->en model, else the copy task (trained once, ~20 s, cached in docs/_build/.cache). A file in the output
# folder that no docs build wrote is never replaced: ARGS=--overwrite allows it (python -m docs.build --help).
# make notebook: annotated/transformer.py as docs/_build/transformer.ipynb, its prose examples and figures as
# code cells, executed (docs/notebook.py; python -m docs.notebook --help). make jupyter: JupyterLab, from
# requirements-notebook.txt (not requirements.txt: the tests need no Jupyter), into .venv, then opens it.
# make screenshots: docs/screenshots/*.png (but heads-pruning.png, make heads' curve) taken in headless Chromium
# from the book and the viewer of the shipped de->en model (docs/screenshots.py); the tests never write there.
.PHONY: docs notebook jupyter screenshots
docs: $(SETUP)
	$(RUN) -m docs.build $(if $(value CHECKPOINT),--checkpoint $(call quoted,CHECKPOINT)) $(ARGS)

screenshots: $(SETUP)
	$(RUN) -m docs.screenshots $(ARGS)

notebook: $(SETUP)
	$(RUN) -m docs.notebook $(ARGS)

jupyter: $(SETUP)
	$(PY) -m pip install -q -r requirements-notebook.txt
	test -f docs/_build/transformer.ipynb || $(PY) -m docs.notebook
	$(PY) -m jupyterlab $(if $(filter 0,$(shell id -u)),--allow-root) docs/_build/transformer.ipynb
