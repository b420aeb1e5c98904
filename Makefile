# The two entry points of the README. Each creates/updates .venv itself.
.PHONY: setup demo train test test-slow lint
setup:
	bash scripts/setup_env.sh
demo train: setup
	.venv/bin/covrl train --config configs/default.yaml
test: setup
	.venv/bin/python -m pytest
test-slow: setup
	.venv/bin/python -m pytest -m slow
# ruff, then the import contracts of pyproject.toml ([tool.importlinter]: layers, no cycles)
lint: setup
	.venv/bin/ruff check src tests scripts
	.venv/bin/lint-imports --no-cache
