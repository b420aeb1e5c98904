#!/bin/bash
# Diagnosis runs after design G (studies/tta/README.md, section 12): covrl's arm alone with one change, on the
# tasks and seeds given, each compared with design G's covrl and TRL runs of the same task and seed.
#   bash studies/tta/run_diagnosis.sh ARM "TASK ..." "SEED ..."
# One run at a time; a task x seed whose result exists is skipped, so the script can be run again to go on.
cd "$(dirname "$0")/../.."
ARM=${1:?usage: run_diagnosis.sh ARM TASKS SEEDS}
TASKS=${2:?tasks}
SEEDS=${3:-"0 1 2"}
case $ARM in
  default) SET=() ;;                                                   # design G's covrl arm on this code
  r32) SET=(--set sizing.rollouts_per_step=32) ;;                      # 32 rollouts a step: fewer, larger steps
  skip) SET=(--set selection.strategy=skip_constant) ;;                # prompts whose last group was constant wait
  clipcov) SET=(--set algorithm.clip_cov=0.05) ;;                      # Clip-Cov: 5% of each group's tokens (section 13)
  clipcov10) SET=(--set algorithm.clip_cov=0.1) ;;                     # Clip-Cov: 10% of each group's tokens (section 14)
  clipcov20) SET=(--set algorithm.clip_cov=0.2) ;;                     # Clip-Cov: 20% of each group's tokens (section 14)
  *) echo "unknown arm $ARM" >&2; exit 2 ;;
esac
COVRL=${COVRL:-.venv/bin/covrl}
# glibc keeps freed memory in the process (docs/performance.md, "Machine and method")
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
export MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-536870912}
for task in $TASKS; do for seed in $SEEDS; do
  out=studies/tta/runs/diagnosis/$ARM/$task-s$seed
  if ls "$out"/*/*.json >/dev/null 2>&1; then continue; fi
  mkdir -p "$out"
  "$COVRL" bench tta --model smollm2 --tasks "$task" --seeds "$seed" --budget-s 240 --arms covrl "${SET[@]}" \
    --out "$out" > "$out/log.txt" 2>&1
done; done
