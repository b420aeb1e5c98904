#!/usr/bin/env bash
# The registered design of studies/selection/README.md: default and select arms of a seed together, then TRL.
set -u
out=${1:-runs/selection}
mkdir -p "$out"
suite() { python -m studies suite --tasks sub1 --budget-s 180 --eval-interval-s 30 "$@"; }
for seed in 0 1 2; do
  suite --sides covrl --seeds "$seed" --out "$out/default" > "$out/default-s$seed.log" 2>&1 &
  suite --sides covrl --seeds "$seed" --out "$out/select" --covrl-set selection.strategy=thompson \
    --covrl-set selection.group_sizes=adaptive > "$out/select-s$seed.log" 2>&1 &
  wait
done
suite --sides trl --seeds 0 --out "$out/trl-s0" > "$out/trl-s0.log" 2>&1 &
suite --sides trl --seeds 1 --out "$out/trl-s1" > "$out/trl-s1.log" 2>&1 &
wait
suite --sides trl --seeds 2 --out "$out/trl-s2" > "$out/trl-s2.log" 2>&1
