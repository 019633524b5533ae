# The README's two commands: `make demo` (set up + paired smoke run + report) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo kv-demo kv-study test setup data bench bench-kernels lint clean

setup: $(STAMP)

# torch first, by exact version: pip takes the CPU build on this machine's disk (plain `torch`
# would pull a multi-GB CUDA build). Then the pinned lock, then the project itself (no deps).
$(STAMP): pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(PY) experiments/stress_8k.py --preset smoke

# The KV-eviction study's 8 cells on the shipped text sample (CPU, about a minute; no corpus).
kv-demo: $(STAMP)
	$(PY) experiments/kv_eviction.py --preset tiny

# The KV-eviction study in one command on the CPU: the tiny cells (trained unless they are),
# then the tables and Figure 1 under runs/kv_tiny/study/.
kv-study: $(STAMP)
	$(PY) experiments/kv_study.py --preset tiny

test: $(STAMP)
	$(PY) -m pytest -q

# The offline text corpus for the causal-LM study: data/text/{train,val,test}.bin (idempotent).
data: $(STAMP)
	$(PY) experiments/prepare_text.py

# GPU only (a CUDA torch in the active environment): the model step and kernel benchmarks.
bench:
	$(PYTHON) experiments/bench/bench_model.py

bench-kernels:
	$(PYTHON) experiments/bench/bench_attention.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs
