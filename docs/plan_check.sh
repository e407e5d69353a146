#!/usr/bin/env bash
# plan's calibrated estimate against bench.py's measured step times on 8 simulated CPU devices of
# the machine at hand (docs/plan.md, "Checked against measurement"): the calibration, one bench run
# per rule file over the four meshes, plan --compare with the calibration, then the table.
#
#   bash docs/plan_check.sh OUT_DIR
#
# The benches run ROUNDS times (default 2), the rule files in reverse order in every other round, and
# each point's measured time is the mean of its rounds' medians: a drift in the machine's speed over
# the run then weighs alike on every point. Each part is skipped when its file in OUT_DIR exists, so
# the work may be spread over several calls. RULES, MESHES, ROUNDS, STEPS (default 5), WARMUP (3) and
# PYTHON may be set in the environment.
set -eu
out=${1:?usage: bash docs/plan_check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python}
rules=${RULES:-dp,fsdp,megatron_1d,megatron_1d_sp,megatron_2d}
meshes=${MESHES:-"dp=8,mp=1 dp=4,mp=2 dp=2,mp=4 dp=1,mp=8"}
export JAX_PLATFORMS=cpu
if [ ! -s "$out/calibration.json" ]; then
  $py -m gspmd_tp.plan calibrate --out="$out/calibration.json"
fi
order=${rules//,/ }
reverse=$(printf '%s\n' $order | tac | tr '\n' ' ')
for round in $(seq 1 "${ROUNDS:-2}"); do
  if [ $((round % 2)) = 0 ]; then rs=$reverse; else rs=$order; fi
  for r in $rs; do
    if [ ! -s "$out/bench_${round}_$r.json" ]; then
      $py bench.py --config=configs/bench_cpu.py --rules="$r" --meshes="$meshes" --steps="${STEPS:-5}" \
        --warmup="${WARMUP:-3}" --json_out="$out/bench_${round}_$r.json"
    fi
  done
done
if [ ! -s "$out/plan.json" ]; then
  $py -m gspmd_tp.plan --config=configs/bench_cpu.py --compare="$rules" --meshes="$meshes" \
    --calibration="$out/calibration.json" --json > "$out/plan.json.part"
  mv "$out/plan.json.part" "$out/plan.json"
fi
$py docs/plan_check.py "$out/plan.json" "$out"/bench_*.json | tee "$out/table.md"
