#!/usr/bin/env bash
# Makes a throwaway folder of packages with verl's own code for tests/math/test_vs_verl.py (covrl.math compared
# with verl.trainer.ppo.core_algos / rollout_corr_helper on random inputs). verl comes without its dependencies
# (no vLLM, Ray or CUDA): only the few packages `import verl.trainer.ppo.core_algos` needs that covrl's venv lacks.
# torch and everything else come from the venv the tests run in, since the folder is appended to sys.path.
#
#   scripts/setup_verl_site.sh [DIR]          # default DIR: /tmp/covrl-verl-site (~28 MB, seconds with a pip cache)
#   COVRL_VERL_SITE=DIR pytest tests/math/test_vs_verl.py
#   COVRL_VERL_SITE=DIR python tests/math/test_vs_verl.py     # prints the max |Δ| table of docs/math.md
set -euo pipefail
DIR=${1:-/tmp/covrl-verl-site}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}
"$PY" -m pip install -q --no-deps --target "$DIR" \
  verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 \
  orjson==3.13.0
echo "COVRL_VERL_SITE=$DIR"
