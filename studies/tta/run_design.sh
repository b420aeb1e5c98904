#!/bin/bash
# A registered design of the suite against TRL (DESIGN_C.md, DESIGN_D.md, DESIGN_E.md, DESIGN_F.md, DESIGN_G.md; `bash studies/tta/run_design.sh G`):
# every task x seed in the design's order, two at a time (one per core; WORKERS=1 runs one at a time), each with
# the design's command, results under studies/tta/runs/<design>/. A task x seed whose result exists is skipped,
# so the script can be run again to go on.
cd "$(dirname "$0")/../.."
DESIGN=${1:?usage: run_design.sh C|D|E|F|G}
case $DESIGN in
  C|D) TASKS="add1 add2 mul1 count_letters reverse_word rg_leg_counting rg_gcd rg_simple_equations rg_spell_backward rg_word_sorting rg_basic_arithmetic" ;;
  # design E runs its six new tasks; its other three are design D's runs (DESIGN_E.md, "Reused runs")
  E) TASKS="sub1 rg_chain_sum_ln rg_basic_arithmetic_ln rg_gcd_ln rg_leg_counting_ln rg_simple_equations_ln" ;;
  # design F: its eleven tasks, then add2 and mul1 (reported outside its verdict)
  # design G: design F's tasks and order, the default with the budget rule compared with the probe
  F|G) TASKS="count_letters sub1 rg_chain_sum_ln rg_basic_arithmetic_ln rg_gcd_ln rg_leg_counting_ln rg_simple_equations_ln rg_letter_counting_ln rg_lcm_ln rg_count_bits_ln rg_products_ln add2 mul1" ;;
  *) echo "unknown design $DESIGN" >&2; exit 2 ;;
esac
COVRL=${COVRL:-.venv/bin/covrl}
# These glibc settings keep freed memory in the process instead of handing it back to the kernel. On a VM whose
# balloon reports free pages to the host, memory handed back is faulted in again at every step: that made both
# arms' steps up to 2.5 times slower than in design F's runs (studies/tta/README.md section 11, runs/control).
# They change no number a step computes, only how long it takes, and both arms get them alike.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
export MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-536870912}
jobs=()
for task in $TASKS; do for seed in 0 1 2; do jobs+=("$task $seed"); done; done
run_one() {
  local task=$1 seed=$2 out=studies/tta/runs/$DESIGN/$1-s$2
  if ls "$out"/*/*.json >/dev/null 2>&1; then return; fi
  mkdir -p "$out"
  "$COVRL" bench tta --model smollm2 --tasks "$task" --seeds "$seed" --budget-s 240 --out "$out" > "$out/log.txt" 2>&1
}
WORKERS=${WORKERS:-2}
worker() {   # worker k of WORKERS takes jobs k, k+WORKERS, ...
  local k=$1
  for ((i = k; i < ${#jobs[@]}; i += WORKERS)); do run_one ${jobs[$i]}; done
}
for ((k = 0; k < WORKERS; k++)); do worker $k & done
wait
