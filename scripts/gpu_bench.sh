#!/usr/bin/env bash
# perfrun's GPU benchmarks, by suite, into one output folder.
#
#   scripts/gpu_bench.sh [--out DIR] SUITE [SUITE ...]
#
# Suites (each writes its logs and JSON under DIR, default outputs/benchmarks/DATE_TIME):
#   tests          pytest -m gpu (every GPU-only test)
#   gpu-check      perfrun gpu-check --json
#   trainer        scripts/bench_train.py: perfrun vs a plain PyTorch loop, GPT-2 124M, bf16, compile
#   monitor        a monitored training run and the monitor-overhead benchmark
#   distributed    DDP/FSDP2 GPU tests, plain vs DDP vs FSDP2 on one GPU (eager, compiled),
#                  an FSDP2 run through torchrun with sharded checkpoints and its resume, a sweep
#   compile-scope  compile_options.scope=model vs blocks under none/ddp/fsdp
#   fsdp-cost      FSDP2's one-GPU host overhead, gpt2 to gpt2-xl: plain vs FSDP2 vs FSDP2 with its host-overhead settings
#   generate       scripts/bench_generate.py (where present)
#   speed          scripts/bench_speed.py: the speed knobs (device input, loss=chunked, fp8, compile
#                  modes, all of them) against the plain nanoGPT-recipe loop; gpt2 and the tiny model
#   all            every suite above, in that order
#
# Run from the repository's root. Python is python3 unless PYTHON is set; the checkout is put
# on PYTHONPATH, so perfrun need not be installed. The last lines printed are a short digest.
set -uo pipefail
OUT_DIR="outputs/benchmarks/$(date +%Y-%m-%d_%H-%M-%S)"
if [ "${1:-}" = "--out" ]; then OUT_DIR="$2"; shift 2; fi
[ $# -gt 0 ] || { sed -n 2,21p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PERFRUN_CACHE=${PERFRUN_CACHE:-/tmp/perfrun-cache} COLUMNS=160
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"

machine() {
  { nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"; git rev-parse HEAD 2>/dev/null; date -u; } \
    > "$R/machine.txt" 2>&1
  cat "$R/machine.txt"
}

suite_tests() {
  "$PY" -m pytest -m gpu -q -p no:cacheprovider > "$R/pytest_gpu.txt" 2>&1
  echo "pytest -m gpu rc=$?: $(tail -1 "$R/pytest_gpu.txt")" >> "$DIGEST"
}

suite_gpu_check() {
  "$PY" -m perfrun gpu-check --json > "$R/gpu-check.json" 2> "$R/gpu-check.err"
  echo "gpu-check rc=$?" >> "$DIGEST"
}

suite_trainer() {
  "$PY" scripts/bench_train.py --steps 50 --warmup 15 --repeats 3 --json "$R/bench_train_gpt2.json" \
    $GPT2 compile=true > "$R/bench_train_gpt2.txt" 2>&1
  tail -1 "$R/bench_train_gpt2.txt" >> "$DIGEST"
}

suite_monitor() {
  "$PY" -m perfrun train $GPT2 compile=true max_steps=150 monitor.every_n_steps=10 checkpoint.at_end=false \
    progress=plain hydra.run.dir="$R/monitored_run" > "$R/monitored_run.txt" 2>&1
  "$PY" scripts/bench_monitor.py --steps 60 --warmup 10 --repeats 2 --json "$R/bench_monitor.json" \
    model=gpt2 data=synthetic dataloader.batch_size=8 device=cuda precision=bf16 > "$R/bench_monitor.txt" 2>&1
  tail -1 "$R/bench_monitor.txt" >> "$DIGEST"
}

suite_distributed() {
  "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_fsdp.py tests/test_distributed.py \
    > "$R/pytest_gpu_distributed.txt" 2>&1
  echo "pytest -m gpu (distributed) rc=$?" >> "$DIGEST"
  for c in false true; do
    "$PY" scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_distributed_compile_$c.json" \
      $GPT2 compile=$c > "$R/bench_distributed_compile_$c.txt" 2>&1
    tail -3 "$R/bench_distributed_compile_$c.txt" >> "$DIGEST"
  done
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $GPT2 distributed=fsdp \
    max_steps=40 progress=plain checkpoint.every_n_steps=20 hydra.run.dir="$R/fsdp_nccl" > "$R/fsdp_nccl.txt" 2>&1
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $GPT2 distributed=fsdp \
    max_steps=40 progress=plain resume="$R/fsdp_nccl/checkpoints/step_0000020" hydra.run.dir="$R/fsdp_resumed" \
    > "$R/fsdp_resumed.txt" 2>&1
  rm -rf "$R"/fsdp_nccl/checkpoints "$R"/fsdp_resumed/checkpoints
  "$PY" -m perfrun train -m distributed=none,ddp,fsdp $GPT2 max_steps=40 checkpoint.at_end=false progress=plain \
    hydra.sweep.dir="$R/distributed_sweep" > "$R/distributed_sweep.txt" 2>&1
  echo "distributed sweep rc=$?" >> "$DIGEST"
}

suite_compile_scope() {
  for scope in model blocks; do
    "$PY" scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_compile_scope_$scope.json" \
      $GPT2 compile=true compile_options.scope=$scope > "$R/bench_compile_scope_$scope.txt" 2>&1
    tail -3 "$R/bench_compile_scope_$scope.txt" >> "$DIGEST"
  done
}

suite_fsdp_cost() {
  # FSDP2's one-GPU host overhead against model size: plain, FSDP2 as it was (every group resharded, implicit
  # prefetch) and FSDP2 with the host-overhead settings (scripts/bench_distributed.py TUNED); eager on gpt2 to
  # gpt2-xl, compiled on gpt2 and gpt2-xl with the GPU-busy share of 3 profiled warm-up steps.
  # Time on an H200, estimated from the H100 runs of BENCHMARKS.md (gpt2 bs16 eager 54 ms/step plain, 77-115
  # under FSDP2; medium ~2.5x, large ~4x, xl at bs8 ~4x gpt2's step; ~10 s of setup per job; a cold compile of
  # gpt2 ~25 s): eager, 12 jobs of 25 steps ~4 min; compiled gpt2, 3 jobs ~1.5 min; compiled gpt2-xl, 3 jobs
  # ~3 min (~60 s for the plain job's 48-block graph, one block's graph under FSDP2): ~8.5 min, under 9.
  local sizes="data=synthetic device=cuda precision=bf16"
  "$PY" scripts/bench_distributed.py --steps 25 --warmup 10 --models gpt2,gpt2-medium,gpt2-large,gpt2-xl \
    --compile false --json "$R/bench_fsdp_sizes_eager.json" $sizes > "$R/bench_fsdp_sizes_eager.txt" 2>&1
  echo "fsdp-cost eager rc=$?" >> "$DIGEST"
  "$PY" scripts/bench_distributed.py --steps 25 --warmup 10 --gpu-busy --models gpt2,gpt2-xl \
    --compile true --json "$R/bench_fsdp_sizes_compiled.json" $sizes > "$R/bench_fsdp_sizes_compiled.txt" 2>&1
  echo "fsdp-cost compiled rc=$?" >> "$DIGEST"
  sed -n '/^ *model batch compile/,$p' "$R"/bench_fsdp_sizes_{eager,compiled}.txt >> "$DIGEST"
}

suite_generate() {
  if [ ! -f scripts/bench_generate.py ]; then echo "generate: scripts/bench_generate.py is not in this checkout" >> "$DIGEST"; return; fi
  "$PY" scripts/bench_generate.py --device cuda --json "$R/bench_generate.json" > "$R/bench_generate.txt" 2>&1
  tail -12 "$R/bench_generate.txt" >> "$DIGEST"
}

suite_speed() {
  "$PY" scripts/bench_speed.py --steps 60 --warmup 20 --repeats 3 --json "$R/bench_speed_gpt2.json" \
    $GPT2 compile=true > "$R/bench_speed_gpt2.txt" 2>&1
  echo "speed (gpt2) rc=$?" >> "$DIGEST"
  grep -E "^(plain|host|perfrun|loss|precision|mode|all|skipped)" "$R/bench_speed_gpt2.txt" >> "$DIGEST"
  "$PY" scripts/bench_speed.py --steps 200 --warmup 50 --repeats 3 --json "$R/bench_speed_tiny.json" \
    model=tiny data=synthetic dataloader.batch_size=16 device=cuda precision=bf16 compile=true \
    > "$R/bench_speed_tiny.txt" 2>&1
  echo "speed (tiny) rc=$?" >> "$DIGEST"
  grep -E "^(plain|host|perfrun|loss|precision|mode|all|skipped)" "$R/bench_speed_tiny.txt" >> "$DIGEST"
}

ALL="tests gpu-check trainer monitor distributed compile-scope fsdp-cost generate speed"
SUITES=()
for s in "$@"; do
  if [ "$s" = all ]; then SUITES+=($ALL); continue; fi
  case " $ALL " in *" $s "*) SUITES+=("$s") ;; *) echo "gpu_bench.sh: unknown suite $s; the suites are: $ALL all" >&2; exit 2 ;; esac
done
R=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd) || exit 2
DIGEST="$R/digest.txt"
machine
: > "$DIGEST"
for s in "${SUITES[@]}"; do
  echo "== $s ($(date -u +%H:%M:%S))"
  "suite_${s//-/_}"
done
echo "results in $R"
cat "$DIGEST"
