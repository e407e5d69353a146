#!/usr/bin/env bash
# plan's calibrated estimate against bench.py's measured step times for the one-device variants of
# configs/llama_1b.py on the GPU at hand (docs/plan.md, "The step-time estimate"): the
# calibration, then per variant one bench run (docs/bench_gpu.sh) and one plan --calibration, whose
# compile the bench run's leaves in the compilation cache; then the table (docs/plan_check.py).
#
#   bash docs/plan_check_gpu.sh OUT_DIR [VARIANT ...]
#
# VARIANT as in docs/bench_gpu.sh (NAME:OVERRIDES). Each part is skipped when its file in OUT_DIR
# exists. PYTHON may be set in the environment.
set -u
out=${1:?usage: bash docs/plan_check_gpu.sh OUT_DIR [VARIANT ...]}
shift
mkdir -p "$out/json" "$out/plan" "$out/hlo"
py=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/jax_cache}
if [ $# -eq 0 ]; then
  set -- \
    "llama_1b:-" \
    "dots_no_batch:model.remat=dots_no_batch" \
    "remat_full:model.remat=full" \
    "cudnn_b16:batch_size=16 model.remat=dots_no_batch" \
    "xla_attention_b16:model.attention=xla batch_size=16 model.remat=dots_no_batch"
fi
if [ ! -s "$out/calibration.json" ]; then
  $py -m gspmd_tp.plan calibrate --out="$out/calibration.json" --matmul_sizes=512,1024,2048,4096,8192 \
    --memory_sizes=65536,1048576,16777216,67108864,268435456
fi
for v in "$@"; do
  IFS=: read -r name overrides _ <<<"$v"
  [ -s "$out/json/$name.json" ] || bash "$(dirname "$0")/bench_gpu.sh" "$out" "$v"
  if [ ! -s "$out/plan/$name.json" ]; then
    args=()
    if [ "$overrides" != "-" ]; then
      read -ra kv <<<"$overrides"
      for o in "${kv[@]}"; do args+=("--config.$o"); done
    fi
    $py -m gspmd_tp.plan --config="${CONFIG:-configs/llama_1b.py}" --config.rules=dp --config.mesh=dp=1,mp=1 \
      "${args[@]}" --calibration="$out/calibration.json" --dump_hlo="$out/hlo/$name" --json \
      > "$out/plan/$name.json.part" && mv "$out/plan/$name.json.part" "$out/plan/$name.json"
  fi
done
$py "$(dirname "$0")/plan_check.py" --variants "$out/plan" "$out/json" | tee "$out/table.md"
