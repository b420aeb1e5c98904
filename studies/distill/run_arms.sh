#!/usr/bin/env bash
# The registered design of studies/distill/README.md: rl and opd arms, seeds 0-2, two runs at a time.
set -u
teacher=$1
out=${2:-runs/distill}
mkdir -p "$out"
run() {
  arm=$1 seed=$2
  extra=()
  [ "$arm" = opd ] && extra=(algorithm.loss=reinforce distill.teacher.source=hf "distill.teacher.path=$teacher")
  covrl train --config configs/default.yaml --no-progress --name "distill-$arm-s$seed" run.seed="$seed" \
    run.output_dir="$out" eval.every_rollouts=80 "${extra[@]}" > "$out/distill-$arm-s$seed.log" 2>&1
}
for seed in 0 1 2; do
  run rl "$seed" &
  run opd "$seed" &
  wait
done
