# The two entry points of the README. Each creates/updates .venv itself.
.PHONY: setup setup-vllm demo train test test-slow lint
setup:
	bash scripts/setup_env.sh
# .venv-vllm: the CPU build of vLLM for the vLLM sampler tests (COVRL_SKIP_VLLM=1 skips it and them)
setup-vllm:
	bash scripts/setup_vllm_env.sh
demo train: setup
	.venv/bin/covrl train --config configs/default.yaml
# TEST_WORKERS: pytest-xdist processes for the default suite (2 on a 2-core machine; 0 runs it in this process)
TEST_WORKERS ?= 2
# the tests that need vLLM, run in .venv-vllm
VLLM_TESTS = tests/rollout/test_vllm.py tests/rollout/test_vllm_bench.py
# The two venvs build side by side (pip keeps about one core busy each). --dist loadgroup: a module marked
# xdist_group (one costly shared fixture) runs on one worker.
test:
	$(MAKE) --no-print-directory -j2 setup setup-vllm
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup
	if [ "$${COVRL_SKIP_VLLM:-0}" != "1" ]; then .venv-vllm/bin/python -m pytest $(VLLM_TESTS); fi
test-slow: setup setup-vllm
	.venv/bin/python -m pytest -m slow
	if [ "$${COVRL_SKIP_VLLM:-0}" != "1" ]; then .venv-vllm/bin/python -m pytest -m slow $(VLLM_TESTS); fi
# ruff, then the import contracts of pyproject.toml ([tool.importlinter]: layers, no cycles)
lint: setup
	.venv/bin/ruff check src tests scripts
	.venv/bin/lint-imports --no-cache
