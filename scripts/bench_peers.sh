#!/usr/bin/env bash
# l3worker beside vLLM's CPU build and llama.cpp on this machine, all three driven by vLLM's own
# client, one engine at a time: a thin wrapper around the shared peers kit's driver (vs_vllm.sh,
# in PEERS, default ../shared/peers beside the checkout). The peers are installed on first use into
# PEERS_BUILD (default ../peers-build), never into the project's environment, and never in CI.
#
#   scripts/bench_peers.sh                # the 27M and 128M random Qwen3 checkpoints, bf16
#   scripts/bench_peers.sh 128m           # one of them
#   REPEATS=3 scripts/bench_peers.sh 128m # repeated runs (each a full alternation of the three engines)
#   python scripts/peer_run_medians.py ../peers-build/runs/128m-*   # then their medians, target by target
#
# Each run prints the driver's table, then l3worker's offline figure against the compute limit that
# scripts/bench_compute_limit.py measures just before, and keeps every log under PEERS_BUILD/runs/<size>-<n>/.
# l3worker serve gets the KV memory share the kit gives vLLM (--gpu-memory-utilization 0.3): each
# run's 16-client requests repeat its 1-client prompts, which vLLM's and llama.cpp's caches keep.
# Extra l3worker serve flags: L3WORKER_FLAGS="--cpu-layout spare_core". Prompt and output lengths:
# INPUT_LEN and OUTPUT_LEN (default 128 each). About 15-25 min a model and run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
BUILD=${PEERS_BUILD:-$ROOT/../peers-build}
LV=${LV:-$(dirname "$(dirname "$(command -v l3worker)")")}  # the venv l3worker is installed in
[ -x "$PEERS/vs_vllm.sh" ] || { echo "no peers kit at $PEERS (set PEERS)" >&2; exit 2; }
[ -x "$LV/bin/l3worker" ] || { echo "no l3worker in $LV (activate the project's venv, or set LV)" >&2; exit 2; }
mkdir -p "$BUILD"
[ -x "$BUILD/vllm-venv/bin/vllm" ] || bash "$PEERS/setup_vllm_cpu.sh" "$BUILD/vllm-venv"
[ -x "$BUILD/llama/bin/llama-server" ] || bash "$PEERS/setup_llama_cpp.sh" "$BUILD/llama"
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(27m 128m)
for size in "${sizes[@]}"; do
  ck="$BUILD/ck-$size"
  [ -f "$ck/model.safetensors" ] || "$LV/bin/python" "$PEERS/make_ckpt.py" "$ck" "$size"
  for n in $(seq 1 "${REPEATS:-1}"); do
    out="$BUILD/runs/$size-$n"
    rm -rf "$out" && mkdir -p "$out"
    echo "== $size, run $n ($(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
    # The compute limit of the offline workload, measured just before the engines' offline runs.
    "$LV/bin/python" "$ROOT/scripts/bench_compute_limit.py" "$ck" --num-prompts "${NUM_PROMPTS:-64}" \
      --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" --max-num-seqs "${MAX_NUM_SEQS:-16}" \
      > "$out/compute_limit.log" 2>&1 || true
    # shellcheck disable=SC2086  # L3WORKER_FLAGS is a list of flags
    VV="$BUILD/vllm-venv" LV="$LV" LCPP="$BUILD/llama" bash "$PEERS/vs_vllm.sh" "$ck" "$out" bfloat16 \
      --served-model-name "$ck" --gpu-memory-utilization 0.3 ${L3WORKER_FLAGS:-}
    limit=$(sed -n 's/^round 1: limit \([0-9]*\) output tok\/s.*/\1/p' "$out/compute_limit.log")
    offline=$(sed -n 's/^Throughput: .*, \([0-9.]*\) output tokens\/s.*/\1/p' "$out/l_tput.log")
    if [ -n "$limit" ] && [ -n "$offline" ]; then
      echo "compute limit (scripts/bench_compute_limit.py, before the run): $limit output tok/s;" \
        "l3worker offline / limit: $(printf '%.2f' "$(echo "scale=4; $offline / $limit" | bc)")"
    else
      echo "compute limit: not measured (see $out/compute_limit.log)"
    fi
  done
done
