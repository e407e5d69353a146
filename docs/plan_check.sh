#!/usr/bin/env bash
# plan's calibrated estimate against bench.py's measured step times on 8 simulated CPU devices of
# the machine at hand (docs/plan.md, "The step-time estimate"): the calibration (with the
# products of the points' steps timed by shape), BENCH_RUNS bench runs of every rule file x mesh
# (default 2), plan --compare with the calibration, then the table.
#
#   bash docs/plan_check.sh OUT_DIR
#
# Each bench run compiles every rule file x mesh and times them in one process in alternating rounds
# (bench.py --alternate: ROUNDS rounds, default 6, of STEPS steps each, default 2, after WARMUP
# untimed steps, default 3), so that a busy spell of the machine lands on every point alike; each
# point is measured by the median of all its steps in a run, and by the mean of that over the runs
# (one run's points differ from the next's by about 2%, as much as many of the 20 points differ from
# one another). Each part is skipped when its file in OUT_DIR exists, so the work may be spread over
# several calls. RULES, MESHES, BENCH_RUNS, ROUNDS, STEPS, WARMUP and PYTHON may be set in the
# environment.
set -eu
out=${1:?usage: bash docs/plan_check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python}
rules=${RULES:-dp,fsdp,megatron_1d,megatron_1d_sp,megatron_2d}
meshes=${MESHES:-"dp=8,mp=1 dp=4,mp=2 dp=2,mp=4 dp=1,mp=8"}
export JAX_PLATFORMS=cpu
if [ ! -s "$out/calibration.json" ]; then
  $py -m gspmd_tp.plan calibrate --out="$out/calibration.json" --config=configs/bench_cpu.py --rules="$rules" \
    --meshes="$meshes"
fi
benches=()
for i in $(seq 1 "${BENCH_RUNS:-2}"); do
  benches+=("$out/bench_$i.json")
  if [ ! -s "$out/bench_$i.json" ]; then
    $py bench.py --config=configs/bench_cpu.py --rules="$rules" --meshes="$meshes" --alternate \
      --rounds="${ROUNDS:-6}" --round_steps="${STEPS:-2}" --warmup="${WARMUP:-3}" --json_out="$out/bench_$i.json"
  fi
done
if [ ! -s "$out/plan.json" ]; then
  $py -m gspmd_tp.plan --config=configs/bench_cpu.py --compare="$rules" --meshes="$meshes" \
    --calibration="$out/calibration.json" --json > "$out/plan.json.part"
  mv "$out/plan.json.part" "$out/plan.json"
fi
$py docs/plan_check.py "$out/plan.json" "${benches[@]}" | tee "$out/table.md"
