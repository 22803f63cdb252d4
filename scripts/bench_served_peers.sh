#!/usr/bin/env bash
# l3worker serve against llama-server (and optionally vllm serve), served figures only, the engines
# alternated REPEATS times on one checkpoint (every other round in reverse order), each driven by vLLM's
# own client (`vllm bench serve`):
#   c1      1 client, prompts of seed 0
#   c16rep  16 clients, the same prompts again (as the peers kit runs it: caches may hold them)
#   c16new  16 clients, fresh prompts (seed 7): a burst of new prompts, nothing cached
# (LOADS="c1" runs only those named). An engine named l3worker-si<N> is l3worker with --stream-interval N
# (tokens streamed N a chunk), and l3worker-inline is l3worker with --inline-engine (the engine in the
# API server's process), each measured as an engine of its own. The engine base is l3worker with the
# same flags from another checkout, BASE_TREE (say a `git worktree` of an earlier revision): the ratios
# then give this checkout over it, round by round, beside the peers.
# Uses what scripts/bench_peers.sh installed under PEERS_BUILD (the vLLM venv for the client, the
# llama.cpp build, the checkpoints); run that once first. Each engine is started, measured and
# stopped in turn; every log stays under PEERS_BUILD/served/<engine>-<n>/. Each row also gives the
# engine's launch to /health 200; with l3worker and a peer among the engines, the end is l3worker /
# each peer, round by round (scripts/served_ratios.py over PEERS_BUILD/served/figures.tsv).
#
#   scripts/bench_served_peers.sh 128m                   # l3worker and llama.cpp, one round
#   REPEATS=2 ENGINES="l3worker llama" scripts/bench_served_peers.sh 128m
#   L3WORKER_FLAGS="--max-num-batched-tokens 256" scripts/bench_served_peers.sh 128m
#   git worktree add ../base HEAD~1 && BASE_TREE=../base ENGINES="l3worker base llama" scripts/bench_served_peers.sh 27m
#   CLIENT_FLAGS="--temperature 0.6 --top-k 20 --top-p 0.95" scripts/bench_served_peers.sh 128m   # Qwen3's sampling
# The client sends no sampling parameters unless CLIENT_FLAGS gives them: each engine then uses its
# own defaults (l3worker and vLLM: the checkpoint's generation_config.json; llama-server: its chain).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${PEERS_BUILD:-$ROOT/../peers-build}
SIZE=${1:-128m}; CK="$BUILD/ck-$SIZE"; VV="$BUILD/vllm-venv"; LCPP="$BUILD/llama"
NP=${NUM_PROMPTS:-16}; IN=${INPUT_LEN:-128}; OUTLEN=${OUTPUT_LEN:-128}; SEQS=${MAX_NUM_SEQS:-16}
LV=${LV:-$(dirname "$(dirname "$(command -v l3worker)")")}
for need in "$VV/bin/vllm" "$CK/config.json" "$LV/bin/l3worker"; do
  [ -e "$need" ] || { echo "missing $need: run scripts/bench_peers.sh $SIZE first (in l3worker's venv)" >&2
                      exit 2; }
done
for tag in ${LOADS:-}; do
  case $tag in c1|c16rep|c16new) ;; *) echo "unknown load $tag in LOADS: c1, c16rep or c16new" >&2; exit 2 ;; esac
done
for engine in ${ENGINES:-}; do
  case $engine in l3worker|l3worker-inline|l3worker-si[0-9]*|base|llama|vllm) ;;
    *) echo "unknown engine $engine in ENGINES: l3worker, l3worker-inline, l3worker-si<N>, base, llama or vllm" >&2
       exit 2 ;;
  esac
done
if [[ " ${ENGINES:-} " == *" base "* ]] && [ ! -d "${BASE_TREE:-}/l3worker" ]; then
  echo "the engine base needs BASE_TREE, a checkout of l3worker (a git worktree of another revision)" >&2; exit 2
fi
GGUF="$BUILD/served/model-$SIZE.gguf"; mkdir -p "$BUILD/served"
if [[ " ${ENGINES:-l3worker llama} " == *" llama "* ]] && [ ! -f "$GGUF" ]; then
  PATH="$VV/bin:$PATH" "$LCPP/convert.sh" "$CK" "$GGUF" > "$BUILD/served/convert-$SIZE.log" 2>&1
fi
LEN=$((IN + OUTLEN + 256))
start() {  # engine port: becomes the server (exec), so that its pid is the server's
  case $1 in
    # shellcheck disable=SC2086  # L3WORKER_FLAGS is a list of flags
    l3worker*|base) interval=${1#l3worker-si}; [ "$interval" = "$1" ] && interval=1
               layout=(); [ "$1" = l3worker-inline ] && layout=(--inline-engine)
               # base: the other checkout's packages (l3worker, chip_child) come first on the path
               [ "$1" = base ] && export PYTHONPATH="$(cd "$BASE_TREE" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
               exec "$LV/bin/l3worker" serve "$CK" --dtype bfloat16 --max-num-seqs "$SEQS" --max-model-len $LEN \
                --port "$2" --gpu-memory-utilization 0.3 --stream-interval "$interval" "${layout[@]}" \
                ${L3WORKER_FLAGS:-} ;;
    llama) exec "$LCPP/bin/llama-server" -m "$GGUF" --host 127.0.0.1 --port "$2" -c $((SEQS * LEN)) -np "$SEQS" \
             -t "$(nproc)" -tb "$(nproc)" --alias "$CK" ;;
    vllm) exec "$VV/bin/vllm" serve "$CK" --dtype bfloat16 --max-num-seqs "$SEQS" --max-model-len $LEN --port "$2" \
            --gpu-memory-utilization 0.3 ;;
  esac
}
# a figure the client did not print (it failed, or is older) is an empty field, not the end of the run
pick() { { grep -m1 "$2" "$1" || true; } | awk -F: '{gsub(/ /,"",$2); print $2}'; }
pid=""; trap '[ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null || true' EXIT  # no server outlives the driver
FIGURES="$BUILD/served/figures.tsv"; : > "$FIGURES"  # the same figures, tab-separated, for served_ratios.py
printf "%-15s %-7s %10s %12s %10s %10s %8s %9s %7s\n" engine load "tok/s" "TTFT p50" "TPOT p50" "P99 ITL" failed \
  launch_s "req/s"
read -ra ORDER <<< "${ENGINES:-l3worker llama}"
for n in $(seq 1 "${REPEATS:-1}"); do
  # Every other round runs the engines in reverse: a place in the round can be worth a few percent
  # on a shared machine (docs/performance/peers.md), and this way no engine always has the same one.
  engines=("${ORDER[@]}")
  if (( n % 2 == 0 )); then engines=(); for e in "${ORDER[@]}"; do engines=("$e" "${engines[@]}"); done; fi
  for engine in "${engines[@]}"; do
    out="$BUILD/served/$engine-$n"; rm -rf "$out"; mkdir -p "$out"; port=8110
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then echo "port $port is already in use" >&2; exit 1; fi
    t0=$(date +%s.%N)
    start "$engine" $port > "$out/server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      kill -0 $pid 2>/dev/null || { echo "$engine did not start: $out/server.log" >&2; exit 1; }; sleep 0.1
    done
    launch=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')  # to /health 200, 0.1 s polls
    backend=vllm; [ "$engine" = llama ] && backend=openai
    for load in c1:1:0 c16rep:16:0 c16new:16:7; do
      IFS=: read -r tag clients seed <<< "$load"
      [[ " ${LOADS:-c1 c16rep c16new} " == *" $tag "* ]] || continue
      # shellcheck disable=SC2086  # CLIENT_FLAGS is a list of flags
      "$VV/bin/vllm" bench serve --backend $backend --base-url "http://127.0.0.1:$port" --model "$CK" \
        --tokenizer "$CK" --dataset-name random --random-input-len "$IN" --random-output-len "$OUTLEN" \
        --num-prompts "$NP" \
        --max-concurrency "$clients" --seed "$seed" --ignore-eos ${CLIENT_FLAGS:-} > "$out/$tag.log" 2>&1 || true
      log="$out/$tag.log"
      row=("$(pick "$log" "Output token throughput")" "$(pick "$log" "Median TTFT")" "$(pick "$log" "Median TPOT")"
           "$(pick "$log" "P99 ITL")" "$(pick "$log" "^Failed requests:")" "$launch"
           "$(pick "$log" "Request throughput")" "$OUTLEN")
      printf "%-15s %-7s %10s %12s %10s %10s %8s %9s %7s\n" "$engine-$n" "$tag" "${row[@]:0:7}"
      (IFS=$'\t'; echo "$engine"$'\t'"$n"$'\t'"$tag"$'\t'"${row[*]}") >> "$FIGURES"
    done
    kill -TERM $pid; wait $pid || true; pid=""  # stopped: the EXIT trap must not signal a reused pid
  done
done
# the ratios need l3worker and a peer (served_ratios.py refuses figures without either)
engines=" ${ENGINES:-l3worker llama} "
if [[ $engines == *" l3worker"* ]] && [ "$(echo $engines | tr ' ' '\n' | grep -vc '^l3worker')" -gt 0 ]; then
  echo; "$LV/bin/python" "$ROOT/scripts/served_ratios.py" "$FIGURES"
fi
