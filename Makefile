# Two commands set everything up on a fresh machine:
#   make train   trains a small GPT-2 on the embedded corpus
#   make test    runs ruff (make lint), then the whole suite (8 fake CPU devices)
#   make test-quick  the edit loop's tier: everything but what trains end to end, starts processes,
#                or needs Ray, S3, lm-eval, notebooks, a browser or the network (pytest markers),
#                and the tests tests/runs_long.txt lists (over 0.25 s of CPU each when measured)
#   make bench   runs the CPU benchmarks (docs/benchmarks.md)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TRAIN_STAMP := $(VENV)/.installed-train

.PHONY: install browser lint test test-quick train bench bench-gpu clean

# Two stamps: `make train` installs only what training needs (the train extra); `make test` adds the
# test and notebook extras on top (torch, transformers, lm-eval, Ray, moto, Jupyter: gigabytes).
# This environment skips ml_dtypes 0.7.0 (a dependency of jax): importing it costs about 0.6 s of
# CPU in every process against 6 ms for 0.6.0 (perf: numpy's PyUFunc_AddLoop comparing the
# signatures of the ufunc loops it registers), and `make test` starts 179 Python processes.
# pyproject.toml leaves the choice to whoever installs `named`.
DEV_PINS := 'ml_dtypes!=0.7.0'
$(TRAIN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[train]' $(DEV_PINS)
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(PY) -m pip install --quiet -e '.[train,test,notebook]' $(DEV_PINS)
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium for the browser tests (tests/test_screenshots.py, docs/screenshots.py): Debian's
# package, installed when no Chromium is on PATH and we are root (CI); otherwise said and left alone.
BROWSERS := chromium-headless-shell chromium chromium-browser google-chrome
browser:
	@if (for b in $(BROWSERS); do command -v $$b >/dev/null && exit 1; done; exit 0); then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "no Chromium, and not root with apt-get: the browser tests will skip"; fi; \
	fi

# ruff (configured in pyproject.toml): the format check and the linter, zero findings.
LINTED := src tests bench
lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)

# --max-worker-restart 0: a worker that crashes ends the run, named in its summary. pytest-xdist 3.8
# replaces it, but then puts the crashed worker's finished files back on the queue as empty work, and
# the run hangs at its end (pytest-xdist issue 1378); a CI run hung that way until its time ran out.
# -n 2 on CI's 2 cores: the two workers end within a second of each other and keep 1.83 cores busy
# (the rest is tests waiting on the processes they start). Three workers took longer, not less:
# 18:03 wall and 2,097 s CPU against 16:22 and 1,797 s for two, one run each on one quiet machine.
test: lint
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 -q --durations=25 tests

# Bytecode is cached for the tests even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on
# this project's machines): without it every pytest worker rewrites and compiles all test modules again,
# about 7 of the 16 s each worker spends collecting. __pycache__/ is ignored by git.
test test-quick: export PYTHONDONTWRITEBYTECODE :=

QUICK := not slow and not procs and not ray and not s3 and not lmeval and not notebook and not browser and not network
test-quick: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 -q -m "$(QUICK)" tests

# TRAIN_ARGS: overrides for the run, e.g. TRAIN_ARGS="--trainer.num_train_steps 30"
TRAIN_ARGS ?=
train: $(TRAIN_STAMP)
	$(VENV)/bin/named-train --config_path config/gpt2_nano.yaml $(TRAIN_ARGS)

# CPU benchmarks (8 fake devices); JSON in bench/results/. Not timed as a whole since the recommended
# setups (about 9 and 8 minutes for GPT-2 and Llama, each search timing its first 4 layouts) and
# Levanter's first step joined the ~15 minutes it took;
# tables in docs/benchmarks.md. The peer (Haliax + Levanter) runs when bench/.venv-peer can be
# built from PyPI (first time: several minutes more); otherwise its JSON says why it was skipped.
bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/compile_depth.py
	$(PY) bench/memory.py
	$(PY) bench/data_ckpt.py
	$(PY) bench/data_ckpt.py --s3 --ckpt-mb 512 --repeats 3
	$(PY) bench/peer.py
	$(PY) bench/peer.py --model llama
	$(PY) bench/peer.py --setup recommended --measure 4
	$(PY) bench/peer.py --setup recommended --model llama --measure 4
	$(PY) bench/loss.py --baseline 62ea26f
	$(PY) bench/moe.py
	$(PY) bench/decode.py
	$(PY) bench/attention.py
	$(PY) bench/first_step.py
	$(PY) bench/report.py

# One GPU (docs/benchmarks.md §6), from a clean checkout: needs only the machine's jax (with its CUDA
# plugin), equinox and optax, and the wheels bench/fetch_wheels.py put in .whl/ (gpu_mfu.py installs
# them and this tree without an index when `named` does not import). GPT-2 124M and Llama 1B, cuDNN
# and XLA attention, remat offload, explicit mode: the plan in bench/gpu_mfu.py, runs started within
# GPU_BUDGET_S seconds; JSON in GPU_OUT, then the table. Not part of `make bench`.
GPU_PY       ?= python3
GPU_OUT      ?= bench/results
GPU_BUDGET_S ?= 520
bench-gpu:
	$(GPU_PY) bench/gpu_mfu.py --budget-s $(GPU_BUDGET_S) --out $(GPU_OUT)

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
