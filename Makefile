# `make test` is the one test command (README, .ci/run): it makes .venv, installs, runs pytest.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test test-all test-gpu-compile shakespeare clean

$(BIN)/activate: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	touch $(BIN)/activate

venv: $(BIN)/activate

# the tests' requirements on top (libtpu: TPU programs compiled on the CPU); the stamp keeps a rerun from reinstalling
$(VENV)/.test-requirements: $(BIN)/activate requirements-test.txt
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

test: $(VENV)/.test-requirements
	$(BIN)/python -m pytest -q -n auto

# the slow tests too (golden runs, benchmarks-as-tests)
test-all: $(VENV)/.test-requirements
	$(BIN)/python -m pytest -q -n auto -m ""

# NVIDIA GPU programs compiled without a GPU (tests/test_gpu.py, marked gpu_compile): JAX's CUDA plugin (6 GB) in a venv
# of its own, since with the plugin installed every `import jax` of the default suite would look for a GPU
VENV_GPU := .venv-gpu
$(VENV_GPU)/.requirements: requirements.txt requirements-test.txt requirements-gpu.txt
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/pip install -q -r requirements-test.txt -r requirements-gpu.txt
	touch $@

test-gpu-compile: $(VENV_GPU)/.requirements
	$(VENV_GPU)/bin/python -m pytest -q -n auto -m gpu_compile tests/test_gpu.py

# the bundled default: nanoGPT's CPU Shakespeare run (char-level baby GPT, 2000 iters), then samples. Each time it
# starts over: the last run's checkpoints and log are moved to out-shakespeare-char/previous-<time>/ (--start_over)
shakespeare: venv
	$(BIN)/python data/shakespeare_char/prepare.py
	$(BIN)/python train.py config/train_shakespeare_char.py --start_over=True --eval_iters=20 --log_interval=100 \
		--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 \
		--lr_decay_iters=2000 --dropout=0.0
	$(BIN)/python sample.py --out_dir=out-shakespeare-char --num_samples=3 --max_new_tokens=300

clean:
	rm -rf $(VENV) $(VENV_GPU) .pytest_cache
