#!/usr/bin/env bash
# This round's runs of studies/tta/DESIGN.md (design A, seed 0), two lanes at a time, niced (the CPU is shared).
#   bash studies/tta/run_arms.sh stage1             # task B's default and trl, while the probe picks task A
#   bash studies/tta/run_arms.sh rest TASK_A         # stages 2 and 3 (TASK_A: the design's rule on base.json)
set -u
out=${OUT:-studies/tta/runs}
logs=${LOGS:-/tmp/tta_logs}
mkdir -p "$out" "$logs"
B=rg_leg_counting
arm() {  # task arm budget
  nice -n 10 python -m studies.tta.arms --task "$1" --arm "$2" --seed 0 --budget-s "$3" \
    --eval-interval-s "$(( $3 / 2 ))" --out "$out" > "$logs/$1-$2.log" 2>&1
}
lane() {  # "task:arm:budget" specs, one after the other
  for spec in "$@"; do IFS=: read -r t a b <<< "$spec"; arm "$t" "$a" "$b"; done
}
if [ "$1" = stage1 ]; then
  lane "$B:default:240" & lane "$B:trl:240" & wait
else
  A=$2
  lane "$A:default:150" "$A:grpo_clip:150" "$A:lr1e-5:150" "$A:cut_penalty:150" "$A:cosine:150" \
       "$B:cut_penalty:240" &
  lane "$A:trl:150" "$A:shape2x8:150" "$A:no_skip:150" "$A:lr5e-5:150" "$B:grpo_clip:240" &
  wait
fi
