#!/usr/bin/env bash
# One command for whoever has an NVIDIA GPU: every CUDA test and the GPU benchmarks, each under a
# time limit (about 8 minutes in all on one H100), then one summary table, also written to
# $OUT/gpu_check/summary.md (a temporary directory when OUT is unset).
#   bash scripts/gpu_check.sh               # on a CUDA machine
#   bash scripts/gpu_check.sh --cpu-smoke   # the same pipeline on the cpu at tiny shapes: checks the script
#   GPU_CHECK_STEPS="tests serve" bash scripts/gpu_check.sh   # only the steps named (the rest: "not run")
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d)}/gpu_check"
mkdir -p "$out"
py=${PYTHON:-python}
smoke=0
[ "${1:-}" = "--cpu-smoke" ] && smoke=1
if [ $smoke = 0 ] && ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device (--cpu-smoke runs the pipeline on the cpu)" >&2
  exit 2
fi

run() {  # run NAME LIMIT_S CMD...: output to $out/NAME.log, exit status to $out/NAME.rc
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    return
  fi
  echo "== $name (at most ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo $? > "$out/$name.rc"
  tail -n 3 "$out/$name.log"
}

if [ $smoke = 1 ]; then
  run tests 300 $py -m pytest -q -x --junitxml "$out/tests.xml" tests/models/test_fused.py
  run decode 300 $py scripts/bench_gpu.py --device cpu --models tiny --batches 1,2 --prompt-len 8 --new-tokens 4 \
    --repeats 1 --variants floor,l3,l3_eager --json "$out/decode.json"
  run fp8 300 $py scripts/bench_fp8.py --device cpu --models tiny --batches 2 --prompt-len 8 --new-tokens 4 --repeats 1
  run spec 300 $py scripts/bench_spec.py --models story --methods ngram --batches 1 --new-tokens 8 --repeats 1
  run serve 300 $py scripts/bench_serve.py --launch --offline --num-prompts 4 --max-concurrency 2 --max-num-seqs 2 \
    --random-input-len 16 --random-output-len 8 --result-file "$out/serve.json"
else
  # CUDA: the GPU test file, and every test whose kernels run on the GPU instead of Triton's interpreter
  # four pytest-xdist workers: most of the time is Triton compiling kernels, on the CPU. The CPU attention
  # kernels' tests are left to CI: on an H200's host they built the C++ kernels for both instruction sets
  # and held a worker past this step's limit.
  run tests 200 $py -m pytest -q -n 4 --junitxml "$out/tests.xml" tests/gpu tests/models/test_fused.py \
    tests/models/test_moe_triton.py tests/models/test_fp8_linear.py tests/models/test_fp8_moe.py tests/attention \
    --ignore tests/attention/test_cpu_attention.py tests/step/test_decode_graphs.py \
    tests/lora/test_lora_graphs.py
  run decode 200 $py scripts/bench_gpu.py --models 0.6b --batches 1,64 --repeats 2 --variants floor,l3,l3_eager,hf_static \
    --json "$out/decode.json"
  run fp8 60 $py scripts/bench_fp8.py --models 0.6b --batches 1,64 --repeats 1
  run spec 60 $py scripts/bench_spec.py --models story compute --methods ngram --batches 1 8 --repeats 1
  run serve 90 $py scripts/bench_serve.py --launch --offline --num-prompts 64 --max-concurrency 16 \
    --result-file "$out/serve.json"
  run kv_offload 90 $py scripts/bench_kv_offload.py --device cuda --repeats 2
  run kv_fp8 120 $py scripts/bench_kv_fp8.py --device cuda --repeats 1  # 2 repeats ran past 90 s
fi
$py scripts/gpu_summary.py "$out" | tee "$out/summary.md"
