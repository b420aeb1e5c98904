#!/usr/bin/env bash
# The registered design of studies/truncation/README.md: 2 tasks x 2 arms x seeds 0-2, two runs at a time, one
# thread each. Run from the repository root of a pinned checkout: bash studies/truncation/run_arms.sh OUTDIR
set -u
out=${1:-runs/truncation}
mkdir -p "$out"
jobs=()
for task in add1 sub1; do
  ops='[+]'; [ "$task" = sub1 ] && ops='["-"]'
  for seed in 0 1 2; do
    for arm in full replay; do
      jobs+=("$task $arm $seed $ops")
    done
  done
done
run() {
  read -r task arm seed ops <<< "$1"
  covrl train --config configs/default.yaml --no-progress --name "trunc-$task-$arm-s$seed" run.seed="$seed" \
    run.output_dir="$out" sampler.top_p=0.9 correction.is_level=token "correction.is_threshold=[0.5,2.0]" \
    trainer.truncation="$arm" "task.arithmetic.ops=$ops" > "$out/trunc-$task-$arm-s$seed.log" 2>&1
}
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
  run "${jobs[i]}" &
  [ $((i + 1)) -lt ${#jobs[@]} ] && run "${jobs[i + 1]}" &
  wait
done
