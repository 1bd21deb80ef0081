# `make test` is the one test command (README, .ci/run): it makes .venv, installs, runs pytest. Every install takes
# pyproject.toml's groups at constraints.txt's pins (docs/install.md); no pip cache: a CI disk holds two venvs of GBs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALL = pip install -q --no-cache-dir -c constraints.txt

.PHONY: venv test test-slow test-all test-gpu-compile mutants shakespeare chat lock clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# the core: what training and sampling need (no torch, transformers, lm-eval or datasets)
$(VENV)/.core: pyproject.toml constraints.txt | $(BIN)/activate
	$(BIN)/$(INSTALL) -e .
	touch $@

venv: $(VENV)/.core

# the test group on top: every optional group but cuda, pytest, and what the tests start (libtpu: TPU programs
# compiled on the CPU; a Cloud Storage emulator); the stamp keeps a rerun from reinstalling
$(VENV)/.test: pyproject.toml constraints.txt | $(BIN)/activate
	$(BIN)/$(INSTALL) -e ".[test]"
	touch $@

# first the style (ruff: the formatter's layout, then the linter), then the suite; the wall time of both at the end
test: $(VENV)/.test
	@start=$$(date +%s); \
	$(BIN)/ruff format --check . && $(BIN)/ruff check . && $(BIN)/python -m pytest -q -n auto; \
	status=$$?; echo "make test: $$(($$(date +%s) - start)) s"; exit $$status

# the tests marked slow, which make test leaves out to stay short (docs/tests.md: how long each takes): golden runs,
# the larger repeats of claims make test checks (more devices, processes, TPU generations). CI runs them after it.
test-slow: $(VENV)/.test
	$(BIN)/python -m pytest -q -n auto -m slow

# both at once
test-all: $(VENV)/.test
	$(BIN)/python -m pytest -q -n auto -m "not gpu_compile"

# NVIDIA GPU programs compiled without a GPU (tests/test_gpu.py, marked gpu_compile): JAX's CUDA plugin in a venv of
# its own, since with the plugin installed every `import jax` of the default suite would look for a GPU
VENV_GPU := .venv-gpu
$(VENV_GPU)/.requirements: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/$(INSTALL) -e ".[gpu-compile]"
	touch $@

test-gpu-compile: $(VENV_GPU)/.requirements
	$(VENV_GPU)/bin/python -m pytest -q -n auto -m gpu_compile tests/test_gpu.py

# mutation testing (docs/notes/mutation.md): mutmut mutates the core modules ([tool.mutmut] in pyproject.toml) and reruns
# the tests that reach each change; hours on 2 cores, so neither make test nor CI runs it. One module's mutants:
# make mutants MUTANTS='compute.generate.*'. Then the score of each module.
$(VENV)/.mutants: pyproject.toml constraints.txt | $(BIN)/activate
	$(BIN)/$(INSTALL) -e ".[test,mutants]"
	touch $@

mutants: $(VENV)/.mutants
	$(BIN)/mutmut run $(MUTANTS)
	$(BIN)/python tools/mutation_report.py

# the bundled default: nanoGPT's CPU Shakespeare run (char-level baby GPT, 2000 iters), then samples. Each time it
# starts over: the last run's checkpoints and log are moved to out-shakespeare-char/previous-<time>/ (--start_over)
shakespeare: venv
	$(BIN)/python data/shakespeare_char/prepare.py
	$(BIN)/python train.py config/train_shakespeare_char.py config/cpu.py --start_over=True
	$(BIN)/python sample.py --out_dir=out-shakespeare-char --num_samples=3 --max_new_tokens=300

# nanochat's whole pipeline on a CPU in minutes (docs/chat.md), a toy like make shakespeare: its tokenizer and a
# depth-4 base model on Shakespeare's paragraphs, exported as nanochat's checkpoint, finetuned on template
# conversations, then asked a question. Each step starts over; its files are in out-chat-cpu/ and data/*/toy/
CHAT := out-chat-cpu
$(VENV)/.chat: pyproject.toml constraints.txt | $(BIN)/activate
	$(BIN)/$(INSTALL) -e ".[nanochat,parity]"
	touch $@

chat: $(VENV)/.chat
	$(BIN)/python data/nanochat/prepare.py --text=data/shakespeare_char/input.txt --shards=4 --vocab_size=4096 \
		--dir=data/nanochat/toy/shards --tokenizer_dir=data/nanochat/toy/tokenizer
	$(BIN)/python train.py config/nanochat_cpu.py --dataset=nanochat/toy --max_iters=120 --eval_interval=60 \
		--out_dir=$(CHAT)/base --start_over=True
	rm -rf $(CHAT)/nanochat && $(BIN)/python export.py --out_dir=$(CHAT)/base --format=nanochat \
		--to=$(CHAT)/nanochat/base_checkpoints/d4
	$(BIN)/python data/chat/prepare.py --toy --dir=data/chat/toy
	$(BIN)/python train.py config/chat_sft.py --init_from=$(CHAT)/nanochat/base_checkpoints/d4 \
		--dataset=chat/toy --dtype=float32 --mmlu_epochs=1 --gsm8k_epochs=1 --val_tokens=16384 --eval_iters=4 \
		--log_interval=10 --out_dir=$(CHAT)/sft --start_over=True
	$(BIN)/python export.py --out_dir=$(CHAT)/sft --format=nanochat --to=$(CHAT)/nanochat/chatsft_checkpoints/d4
	$(BIN)/python chat_cli.py --init_from=$(CHAT)/nanochat/chatsft_checkpoints/d4 --temperature=0 \
		--prompt="What did Romeo say of the sea?"

# constraints.txt anew: what clean installs of the test and mutants groups, and of the GPU's (gpu-compile, and cuda's
# libraries for GPU machines), resolve to today, frozen whole (pip freeze names versions, never the index they came
# from). torch's local label (+cpu) is dropped: the pin then takes PyPI's torch or the CPU index's. PyPI's is the CUDA
# build, whose NVIDIA libraries an ordinary Linux machine's make test installs: a third venv takes it from PyPI (this
# machine's pip config would find a CPU wheel on disk), so that they are pinned too. tests/test_install.py checks the
# pins against pyproject.toml, and that make test installed nothing unpinned.
LOCK := .venv-lock
lock:
	rm -rf $(LOCK) && $(PYTHON) -m venv $(LOCK)
	$(LOCK)/bin/pip install -q --no-cache-dir -e ".[test,mutants]"
	$(LOCK)/bin/pip freeze --exclude-editable > $(LOCK).test
	rm -rf $(LOCK) && $(PYTHON) -m venv $(LOCK)
	$(LOCK)/bin/pip install -q --no-cache-dir -e ".[gpu-compile,cuda]"
	$(LOCK)/bin/pip freeze --exclude-editable > $(LOCK).gpu
	rm -rf $(LOCK) && $(PYTHON) -m venv $(LOCK)
	sed -E 's/\+[a-z0-9.]+$$//' $(LOCK).test > $(LOCK).pins
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(LOCK)/bin/pip install -q --no-cache-dir -c $(LOCK).pins torch
	$(LOCK)/bin/pip freeze > $(LOCK).torch
	(echo "# Every package that make test, make test-gpu-compile and the cuda group install, pinned (make lock)"; \
	 sed -E 's/\+[a-z0-9.]+$$//' $(LOCK).test $(LOCK).gpu $(LOCK).torch | sort -uf) > constraints.txt
	rm -rf $(LOCK) $(LOCK).test $(LOCK).gpu $(LOCK).pins $(LOCK).torch

clean:
	rm -rf $(VENV) $(VENV_GPU) .pytest_cache mutants
