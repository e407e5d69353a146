#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md ("One H100 GPU"): bench.py on
# configs/llama_1b.py (rules dp, one device), one run per variant, each in its own process (two 1B
# states do not share one GPU's memory), then every report merged into one JSON file.
#
#   bash docs/bench_gpu.sh OUT_DIR [VARIANT ...]
#
# A VARIANT is NAME:OVERRIDES[:ENV]: OVERRIDES are config overrides joined by " " (or "-" for none),
# ENV environment settings joined by ";", e.g.
#   "b16_cublas:batch_size=16:XLA_FLAGS=--xla_gpu_enable_triton_gemm=false;XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"
#   "norms_saved:model.remat_save=attn_in,mlp_in batch_size=16"
# With no VARIANT, the sweep below. CONFIG (default configs/llama_1b.py), STEPS, WARMUP and PER_RUN_S
# (each run's time limit) may be set in the environment.
set -u
out=${1:?usage: bash docs/bench_gpu.sh OUT_DIR [VARIANT ...]}
shift
mkdir -p "$out/json"
steps=${STEPS:-8}
warmup=${WARMUP:-3}
per_run=${PER_RUN_S:-170}
# JAX's allocator takes 75% of the GPU by default; the 1B step at batch 32 needs more on one H100.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
if [ $# -eq 0 ]; then
  set -- \
    "llama_1b:-" \
    "one_pass_mlp:model.mlp_grad=one_pass" \
    "scan_dots_no_batch:model.scan_layers=true model.remat=dots_no_batch" \
    "dots_no_batch:model.remat=dots_no_batch" \
    "remat_full:model.remat=full" \
    "cudnn_b16:batch_size=16 model.remat=dots_no_batch" \
    "xla_attention_b16:model.attention=xla batch_size=16 model.remat=dots_no_batch"
fi
for v in "$@"; do
  IFS=: read -r name overrides env <<<"$v"
  # Unmasked windows: cuDNN's fused attention (model.attention auto on a GPU) takes no segment ids,
  # and under data.document_mask the attention is einsum's (docs/model.md#attention).
  args=(--config.data.document_mask=false)
  if [ "$overrides" != "-" ]; then
    read -ra kv <<<"$overrides"
    for o in "${kv[@]}"; do args+=("--config.$o"); done
  fi
  IFS=";" read -ra envs <<<"${env:-}"
  echo "=== $name: ${args[*]} ${envs[*]}"
  env "${envs[@]}" timeout "$per_run" python3 bench.py --config="${CONFIG:-configs/llama_1b.py}" --rules=dp \
    --meshes=dp=1,mp=1 --steps="$steps" --warmup="$warmup" "${args[@]}" \
    --json_out="$out/json/$name.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -n 4
  echo "=== $name: exit ${PIPESTATUS[0]}"
done
python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
merged = {}
for path in sorted(glob.glob(os.path.join(out, "json", "*.json"))):
    merged[os.path.basename(path)[:-5]] = json.load(open(path))
json.dump(merged, open(os.path.join(out, "bench_gpu.json"), "w"), indent=1)
print(f"{'variant':<28} {'step ms':>8} {'tokens/s':>9} {'MFU':>6} {'compile s':>9} {'temp GiB':>8}")
for name, report in merged.items():
    for r in report["results"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        temp = r["memory_per_device"]["temporaries"] / 2**30
        print(f"{name:<28} {1e3 * r['step_s']:>8.1f} {r['tokens_per_sec']:>9,.0f} {mfu:>6} "
              f"{r['compile_s']:>9.2f} {temp:>8.2f}")
EOF
