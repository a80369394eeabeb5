#!/usr/bin/env bash
# perfrun's GPU benchmarks, by suite, into one output folder.
#
#   scripts/gpu_bench.sh [--dry-run] [--out DIR] SUITE [SUITE ...]
#
# Where GPU time is short, run one suite per command (each is sized to end within 10 minutes), in this order:
#   1. smoke        every CUDA path runs?                                    (<= 8 min by design)
#   2. speed        perfrun's best bf16 and best FP8 configurations against the plain
#                   nanoGPT-recipe loop (the 1.10x and 1.25x targets)        (~5 min)
#   3. speed-fp8    fp8 vs bf16 loss parity, gpt2's fp8 tokens/s             (~3 min)
#   4. starvation   gpu_starved_pct with memmap input (the < 1 % target)     (~3 min)
#   5. ladder-gpt2  the ladder on GPT-2 124M                                  (~8 min)
#   then the rest in the order listed below. Each suite writes DIR/digest_SUITE.md (the GPU,
#   driver, versions and commit first, then its figures), meant to be pasted into BENCHMARKS.md,
#   and appends it to DIR/digest.txt.
#
# Suites (each writes its logs and JSON under DIR, default outputs/benchmarks/DATE_TIME):
#   smoke          every CUDA-only path once, tiny steps and small models, a row per path
#                  (ok / failed and the error's first line / skipped and why) written to its
#                  digest as each ends, so a command cut off keeps what it found; it starts
#                  with the torch APIs perfrun uses that this torch lacks. Rows stop starting
#                  once SMOKE_BUDGET_S (default 480) seconds have passed; pytest -m gpu runs
#                  last, in what is left. It includes model=llama-tiny rows and perfrun
#                  estimate against the measured CUDA peak
#   tests          pytest -m gpu (every GPU-only test)
#   gpu-check      perfrun gpu-check --json
#   trainer        scripts/bench_train.py: perfrun vs a plain PyTorch loop, GPT-2 124M, bf16, compile,
#                  3 alternating pairs in fresh processes, the ratio with its interval
#   monitor        a monitored training run and the monitor-overhead benchmark
#   distributed    DDP/FSDP2 GPU tests, plain vs DDP vs FSDP2 on one GPU (eager, compiled),
#                  an FSDP2 run through torchrun with sharded checkpoints and its resume, a sweep
#   compile-scope  compile_options.scope=model vs blocks under none/ddp/fsdp
#   fsdp-cost      FSDP2's one-GPU host overhead, gpt2 to gpt2-xl: plain vs FSDP2 vs FSDP2 with its host-overhead settings
#   generate       scripts/bench_generate.py: KV cache off, on, and compiled with CUDA graphs, GPT-2 124M
#   speed          scripts/bench_speed.py, GPT-2 124M, 3 repeats: perfrun's best bf16 configuration and
#                  its best with FP8 against the plain nanoGPT-recipe loop (targets: 1.10x and 1.25x);
#                  the fastest variant profiled (its top kernels)                         (~5 min)
#   speed-knobs    the same loop against each speed knob alone (host input, loss=chunked, fp8, the three
#                  compile modes), GPT-2 124M, 2 repeats                                  (~7 min)
#   speed-tiny     every variant on the default model (synthetic tokens of GPT-2's vocabulary), where
#                  launch overhead dominates, 2 repeats                                   (~6 min)
#   ladder-gpt2    +sweep=ablation, GPT-2 124M, synthetic, seq 1024, batch 16, 1 repeat   (~8 min)
#   ladder-tiny    +sweep=ablation, the default model on pysource, 2 repeats              (~5 min)
#                  each ladder call runs the ladder once into DIR/ladder_NAME_N and writes its
#                  perfrun report --markdown; call it again with the same --out and the second
#                  call compares the two runs rung by rung (scripts/compare_ladders.py)
#   starvation     scripts/bench_starvation.py: gpu_starved_pct for synthetic, memmap, and a slow
#                  host source with 0 and 2 workers, GPT-2 at batch 16                    (~3 min)
#   speed-loss     loss=standard vs chunked, compiled, at batch 16 and at the largest batch
#                  each allows (dataloader.batch_size=auto): peak memory and tokens/s      (~5 min)
#   speed-fp8      fp8 vs bf16 loss parity over 300 steps (pysource, synthetic), and gpt2's
#                  fp8 vs bf16 tokens/s                                                    (~3 min)
#   speed-fp8-size fp8 vs bf16 tokens/s on gpt2-medium and gpt2-large                     (~5 min)
#   speed-llama    a Llama-3.2-1B-shaped model (block 2048, batch 4, synthetic tokens of its
#                  vocabulary), bf16 + compile with and without FP8: tokens/s, MFU, memory (~5 min)
#   all            every suite above, in that order
#
# The minutes are estimates for an H100/H200 (not measured yet). --dry-run prints the commands a
# suite would run (DIR shown as $DIR) and runs none of them. Run from the repository's root.
# Python is python3 unless PYTHON is set; the checkout is put on PYTHONPATH, so perfrun need not
# be installed. The last lines printed are the digest.
set -uo pipefail
OUT_DIR="outputs/benchmarks/$(date +%Y-%m-%d_%H-%M-%S)"
DRY=false
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=true; shift ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { sed -n '2,/^[^#]/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; }
PY=${PYTHON:-python3}
REAL_PY=$PY  # what software() runs, also under --dry-run
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PERFRUN_CACHE=${PERFRUN_CACHE:-/tmp/perfrun-cache} COLUMNS=160 \
  PYTHONUNBUFFERED=1
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"

# The software a figure was measured with, one line: Python, torch, CUDA, cuDNN, NCCL, torchao and
# Hydra (one interpreter start, made once: machine.txt and every digest carry it).
software() {
  "$REAL_PY" -c "
import importlib.metadata as m, platform, torch
def v(n):
    try: return m.version(n)
    except m.PackageNotFoundError: return 'not installed'
cuda = torch.cuda.is_available()
print(f'Python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, '
      f'cuDNN {torch.backends.cudnn.version()}, NCCL {\".\".join(map(str, torch.cuda.nccl.version())) if cuda else None}, '
      f'torchao {v(\"torchao\")}, Hydra {v(\"hydra-core\")}')" 2>&1 | tail -1
}

machine() {
  SOFTWARE=$(software)
  { nvidia-smi -L; echo "$SOFTWARE"; git rev-parse HEAD 2>/dev/null; date -u; } > "$R/machine.txt" 2>&1
  cat "$R/machine.txt"
}

# The head of a suite's digest: what a figure pasted into BENCHMARKS.md must carry beside it.
digest_header() {  # digest_header SUITE
  local commit dirty=""
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=" (with uncommitted changes)"
  {
    echo "### \`scripts/gpu_bench.sh $1\`, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader \
2>/dev/null | head -1 | sed 's/, /, driver /2; s/, \([0-9.]* W\)$/, power limit \1/' || echo 'no nvidia-smi'); \
$(nproc) CPUs"
    echo "- software: ${SOFTWARE:-$(software)}"
    echo "- perfrun: commit $commit$dirty"
    echo
  } >> "$DIGEST"
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
  "$PY" scripts/bench_train.py --steps 50 --warmup 15 --pairs 3 --configs custom --json "$R/bench_train_gpt2.json" \
    $GPT2 compile=true > "$R/bench_train_gpt2.txt" 2>&1
  echo "trainer rc=$?" >> "$DIGEST"
  sed -n '/^steps /,$p' "$R/bench_train_gpt2.txt" >> "$DIGEST"
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
  "$PY" scripts/bench_generate.py --device cuda --json "$R/bench_generate.json" > "$R/bench_generate.txt" 2>&1
  tail -12 "$R/bench_generate.txt" >> "$DIGEST"
}

# One scripts/bench_speed.py run into $R/bench_speed_NAME.{txt,json}, its table into the digest.
bench_speed() {  # bench_speed NAME ARGS...
  local name=$1
  shift
  "$PY" scripts/bench_speed.py --json "$R/bench_speed_$name.json" "$@" > "$R/bench_speed_$name.txt" 2>&1
  echo "speed ($name) rc=$?" >> "$DIGEST"
  grep -E "^(plain|host|perfrun|loss|precision|mode|all|skipped|failed)" "$R/bench_speed_$name.txt" >> "$DIGEST"
}

suite_speed() {
  bench_speed gpt2 --steps 60 --warmup 20 --repeats 3 --variants "perfrun,all (bf16),all" \
    --profile-best "$R/profiled_best" $GPT2 compile=true
  sed -n '/^profiled: /,/^Self CUDA time total/p' "$R/bench_speed_gpt2.txt" >> "$DIGEST"
}

suite_speed_knobs() {
  bench_speed knobs --steps 60 --warmup 20 --repeats 2 \
    --variants "perfrun,host input,loss=chunked,precision=fp8,mode=max-autotune-no-cudagraphs,mode=reduce-overhead,mode=max-autotune" \
    $GPT2 compile=true
}

suite_speed_tiny() {
  bench_speed tiny --steps 200 --warmup 50 --repeats 2 \
    model=tiny data=synthetic dataloader.batch_size=16 device=cuda precision=bf16 compile=true
}

# One run of the ladder into $R/ladder_NAME_N (N: the first free number), its Markdown report,
# and, from the second run on, the rung-by-rung comparison with the first.
ladder() {  # ladder NAME GOAL_PCT OVERRIDES...
  local name=$1 goal=$2 n=1
  shift 2
  while [ -e "$R/ladder_${name}_$n" ]; do n=$((n + 1)); done
  local d="$R/ladder_${name}_$n"
  "$PY" -m perfrun train -m +sweep=ablation "$@" progress=plain hydra.sweep.dir="$d" > "$d.txt" 2>&1
  echo "ladder $name run $n rc=$?: $(grep -m1 -o 'verdict: .*' "$d.txt")" >> "$DIGEST"
  "$PY" -m perfrun report "$d" --markdown > "$d.md" 2> "$d.report.err"
  if [ "$n" -ge 2 ] || $DRY; then
    $DRY && { echo "# from the second call with the same --out on:" >&3; d="$R/ladder_${name}_2"; }
    "$PY" scripts/compare_ladders.py "$R/ladder_${name}_1" "$d" --goal "$goal" \
      --json "$R/ladder_${name}_compare.json" > "$R/ladder_${name}_compare.txt" 2>&1
    cat "$R/ladder_${name}_compare.txt" >> "$DIGEST"
  else
    echo "ladder $name: one run ($d, report $d.md); run this suite again with --out $R to compare two" >> "$DIGEST"
  fi
}

# The ladder's rungs but the largest-batch ones: with dataloader.batch_size=16 fixed on the command line (it
# wins over their batch_size=auto) they would run at batch 16 and measure nothing of their own.
GPT2_RUNGS="naive,naive_seed,tf32,bf16,fp16,sdpa,fused_adamw,compile,workers,device_input,chunked_loss,compile_mode,\
fp8,without_tf32,without_bf16,without_sdpa,without_fused_adamw,without_compile,without_workers,without_device_input,\
without_chunked_loss,without_compile_mode,without_fp8,checkpointing_selective,checkpointing_full,accumulation,\
adamw8bit,optim_in_backward,offload_activations"

suite_ladder_gpt2() {  # 29 rungs x 1 repeat; on FP8 GPUs every one but 4 compiled, most in max-autotune mode
  ladder gpt2 3 model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda ablation.repeats=1 \
    "+ablation=$GPT2_RUNGS" max_steps=30 timing_warmup_steps=10 log_every=5 eval_every=0
}

suite_ladder_tiny() {  # the default model and data: 32 rungs x 2 repeats (offload_activations: CUDA)
  ladder tiny 3 device=cuda ablation.repeats=2 max_steps=200 timing_warmup_steps=50 eval_every=0
}

suite_starvation() {  # the memmap corpus: this checkout's Python files, byte tokens (vocab 256)
  find perfrun scripts tests -name '*.py' | LC_ALL=C sort | xargs cat > "$R/memmap_corpus.txt"
  "$PY" -m perfrun prepare path="$R/memmap_corpus.txt" out="$R/memmap_corpus" tokenizer=byte progress=false \
    > "$R/memmap_prepare.txt" 2>&1
  "$PY" scripts/bench_starvation.py --memmap "$R/memmap_corpus" --steps 60 --warmup 20 --sleep-ms 2 \
    --out "$R/starvation" --json "$R/starvation.json" $GPT2 compile=true > "$R/starvation.txt" 2>&1
  echo "starvation rc=$?" >> "$DIGEST"
  grep -E "^(base|case|synthetic|memmap|slow)" "$R/starvation.txt" >> "$DIGEST"
}

# A sweep and its Markdown table (perfrun report) into the digest.
sweep() {  # sweep NAME OVERRIDES...
  local name=$1
  shift
  "$PY" -m perfrun train -m "$@" checkpoint.at_end=false progress=plain monitor.every_n_steps=0 \
    hydra.sweep.dir="$R/$name" > "$R/$name.txt" 2>&1
  echo "$name rc=$?" >> "$DIGEST"
  "$PY" -m perfrun report "$R/$name" --markdown > "$R/$name.md" 2> "$R/$name.report.err"
  cat "$R/$name.md" >> "$DIGEST"
}

suite_speed_loss() {  # loss=standard vs chunked, compiled, at batch 16 and at the largest batch each allows
  local base="model=gpt2 data=synthetic device=cuda precision=bf16 compile=true max_steps=60 timing_warmup_steps=20"
  sweep loss_batch_16 repeat=0,1 loss=standard,chunked $base dataloader.batch_size=16 eval_every=0
  sweep loss_batch_auto loss=standard,chunked $base dataloader.batch_size=auto eval_every=0
}

suite_speed_fp8() {  # loss parity fp8 vs bf16 over 300 steps; the synthetic pair gives gpt2's tokens/s too
  for data in pysource synthetic; do
    sweep "fp8_parity_$data" precision=bf16,fp8 model=gpt2 data=$data dataloader.batch_size=16 device=cuda \
      compile=true max_steps=300 timing_warmup_steps=30 log_every=10 eval_every=0
    "$PY" scripts/loss_parity.py "$R/fp8_parity_$data/0" "$R/fp8_parity_$data/1" > "$R/fp8_parity_$data.parity.txt" 2>&1
    cat "$R/fp8_parity_$data.parity.txt" >> "$DIGEST"
  done
}

suite_speed_fp8_size() {  # fp8 vs bf16 tokens/s on the wider models
  for model in gpt2-medium gpt2-large; do
    sweep "fp8_speed_$model" precision=bf16,fp8 model=$model data=synthetic dataloader.batch_size=16 device=cuda \
      compile=true max_steps=40 timing_warmup_steps=15 eval_every=0
  done
}

suite_speed_llama() {  # the Llama family at a size where FP8 and compile matter: bf16 + compile, with and without FP8
  sweep speed_llama_1b precision=bf16,fp8 model=llama-3.2-1b model.block_size=2048 data=synthetic \
    data.vocab_size=128256 dataloader.batch_size=4 device=cuda compile=true max_steps=40 timing_warmup_steps=15 \
    eval_every=0
}

# ---- smoke: every CUDA-only path once ------------------------------------------------------------
SMOKE_BUDGET_S=${SMOKE_BUDGET_S:-480}
TINY_CUDA="model=tiny data=synthetic dataloader.batch_size=16 device=cuda precision=bf16 max_steps=12 \
timing_warmup_steps=4 log_every=4 eval_every=0 eval_batches=1 checkpoint.at_end=false progress=plain"
GPT2_SMOKE="model=gpt2 data=synthetic dataloader.batch_size=8 device=cuda max_steps=20 timing_warmup_steps=5 \
log_every=5 eval_every=0 eval_batches=1 checkpoint.at_end=false progress=plain"

smoke_table_row() {  # smoke_table_row PATH RESULT DETAIL: appended at once, so a cut-off suite keeps it
  local detail=${3//|/\\|}
  echo "| $1 | $2 | ${detail//$'\n'/ } |" >> "$DIGEST"
  if $DRY; then [ "$2" = ok ] && echo "# row: $1" >&3 || echo "# row: $1: $2: $3" >&3; return 0; fi
  echo "smoke: $1: $2${3:+: $3}"
}

first_error() {  # the first line of the error in a log: perfrun's one line, else the exception's
  local line
  line=$(grep -m1 -E '^perfrun: error: ' "$1")
  [ -n "$line" ] || line=$(grep -E '^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Interrupt|Failed)(: |$)' "$1" | tail -1)
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$1" | tail -1)
  echo "${line:0:300}"
}

# One row: CMD (a python3 call) into $R/smoke_LOGNAME.log, at most CAP seconds and never past the
# suite's budget; ok with NOTE's detail (-: none; tail: the log's last line; DIR KEY...: those of
# DIR/summary.json, scripts/smoke_note.py), failed with the error's first line, or skipped.
smoke_row() {  # smoke_row PATH LOGNAME CAP NOTE CMD...
  local path=$1 log="$R/smoke_$2.log" cap=$3 note=$4 rc left detail
  shift 4
  left=$((SMOKE_END - SECONDS))
  if [ "$left" -lt 20 ]; then
    smoke_table_row "$path" skipped "the suite's ${SMOKE_BUDGET_S} s budget was spent (SMOKE_BUDGET_S)"
    return 1
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  if $DRY; then "$@"; rc=0; else timeout -k 10 "$cap" "$@" > "$log" 2>&1; rc=$?; fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    smoke_table_row "$path" failed "cut off at its ${cap} s limit; last line: $(first_error "$log")"
  elif [ "$rc" -ne 0 ]; then
    smoke_table_row "$path" failed "exit $rc: $(first_error "$log")"
  else
    case "$note" in
      -) detail="" ;;
      tail) detail=$($DRY || grep -v '^[[:space:]]*$' "$log" | tail -1) ;;
      *) read -r -a words <<< "$note"; detail=$("$PY" scripts/smoke_note.py "${words[@]}" 2>&1) ;;
    esac
    smoke_table_row "$path" ok "$detail"
  fi
  return "$rc"
}

suite_smoke() {
  SMOKE_END=$((SECONDS + SMOKE_BUDGET_S))
  printf '| path | result | detail |\n|---|---|---|\n' >> "$DIGEST"
  smoke_row "torch APIs perfrun uses, against this torch" torch_api 60 tail "$PY" scripts/torch_api_probe.py \
    --json "$R/smoke_torch_api.json"
  smoke_row "perfrun gpu-check --quick" gpu_check 120 tail "$PY" -m perfrun gpu-check --quick
  local recipe mode
  for recipe in tensorwise rowwise; do
    smoke_row "precision=fp8 recipe=$recipe, gpt2, compiled, 20 steps" "fp8_$recipe" 150 \
      "$R/smoke_fp8_$recipe knobs.fp8.kept_in_bf16 tokens_per_s_median peak_mem_mib" \
      "$PY" -m perfrun train $GPT2_SMOKE precision=fp8 precision.recipe=$recipe compile=true \
      hydra.run.dir="$R/smoke_fp8_$recipe"
  done
  for mode in default max-autotune-no-cudagraphs reduce-overhead max-autotune; do
    local acc=1
    case $mode in reduce-overhead | max-autotune) acc=2 ;; esac
    smoke_row "compile mode=$mode, accumulation.steps=$acc, tiny" "compile_$mode" 150 \
      "$R/smoke_compile_$mode knobs.compile_options.cuda_graphs compile_s_estimate tokens_per_s_median" \
      "$PY" -m perfrun train $TINY_CUDA compile=true compile_options.mode=$mode accumulation.steps=$acc \
      hydra.run.dir="$R/smoke_compile_$mode"
  done
  smoke_row "loss=chunked, compiled, tiny (GPT-2 vocabulary)" loss_chunked 120 \
    "$R/smoke_loss_chunked knobs.loss tokens_per_s_median peak_mem_mib" \
    "$PY" -m perfrun train $TINY_CUDA loss=chunked compile=true hydra.run.dir="$R/smoke_loss_chunked"
  smoke_memory_knob_rows
  smoke_memmap_rows
  smoke_fsdp_rows
  smoke_row "profile=true memory_snapshot=true, tiny" profile 120 \
    "$R/smoke_profile knobs.profile.gpu.gpu_busy_pct file:profile/trace.json* file:profile/top_ops.txt file:*.pickle" \
    "$PY" -m perfrun train ${TINY_CUDA/max_steps=12/max_steps=16} profile=true profiler.start_step=5 memory_snapshot=true \
    hydra.run.dir="$R/smoke_profile"
  smoke_llama_rows
  smoke_estimate_rows
  smoke_row "pytest -m gpu (in what is left of the budget)" pytest_gpu 600 tail \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider
}

smoke_memory_knob_rows() {  # the memory knobs on CUDA: offloading (CUDA only), 8-bit AdamW, the step in the backward
  local offload
  for offload in activations optimizer; do
    smoke_row "offload=$offload, tiny" "offload_$offload" 120 \
      "$R/smoke_offload_$offload knobs.offload tokens_per_s_median peak_mem_mib" \
      "$PY" -m perfrun train $TINY_CUDA offload=$offload hydra.run.dir="$R/smoke_offload_$offload"
  done
  smoke_row "optim=adamw8bit, optim.in_backward=true, tiny" optim_memory 120 \
    "$R/smoke_optim_memory knobs.optim_in_backward tokens_per_s_median peak_mem_mib" \
    "$PY" -m perfrun train $TINY_CUDA optim=adamw8bit optim.in_backward=true optim.grad_clip=0 \
    hydra.run.dir="$R/smoke_optim_memory"
}

smoke_memmap_rows() {  # a byte corpus of this checkout's Python files, read through the device input path
  find perfrun scripts tests -name '*.py' | LC_ALL=C sort | xargs cat > "$R/smoke_corpus.txt"
  printf 'def main(\nimport os\nclass A:\nfor i in range(\n' > "$R/smoke_prompts.txt"
  smoke_row "perfrun prepare (memmap corpus, byte tokens)" prepare 60 - "$PY" -m perfrun prepare \
    path="$R/smoke_corpus.txt" out="$R/smoke_corpus" tokenizer=byte progress=false
  smoke_row "device input from memmap (copied ahead on a side stream), tiny" memmap 120 \
    "$R/smoke_memmap knobs.input gpu_starved_pct host_data_wait_pct tokens_per_s_median" \
    "$PY" -m perfrun train model=tiny data=memmap data.path="$R/smoke_corpus" dataloader.device_input=true \
    device=cuda precision=bf16 max_steps=20 timing_warmup_steps=5 log_every=5 eval_every=0 eval_batches=1 \
    checkpoint.at_end=true progress=plain hydra.run.dir="$R/smoke_memmap"
  if ! $DRY && ! ls "$R"/smoke_memmap/checkpoints/step_* > /dev/null 2>&1; then
    smoke_table_row "perfrun generate compile=true (CUDA graphs), batch 4" skipped "no checkpoint: the memmap run did not save one"
    return
  fi
  smoke_row "perfrun generate compile=true (CUDA graphs), batch 4" generate 150 tail "$PY" -m perfrun generate \
    checkpoint="$R/smoke_memmap" prompts_file="$R/smoke_prompts.txt" batch_size=4 compile=true max_new_tokens=32 \
    device=cuda
}

smoke_fsdp_rows() {  # FSDP2 through torchrun, one rank, every prefetch setting; saved at step 6, resumed
  local fsdp="distributed=fsdp fsdp.forward_prefetch=1 fsdp.backward_prefetch=1 fsdp.reshard_last_block=true"
  smoke_row "FSDP2, 1 rank, prefetch 1/1, reshard_last_block, saved" fsdp_save 150 \
    "$R/smoke_fsdp knobs.fsdp checkpoints" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $TINY_CUDA $fsdp \
    checkpoint.every_n_steps=6 hydra.run.dir="$R/smoke_fsdp"
  if ! $DRY && [ ! -e "$R/smoke_fsdp/checkpoints/step_0000006" ]; then
    smoke_table_row "FSDP2, 1 rank, resumed from step 6" skipped "no step_0000006 checkpoint from the row above"
    return
  fi
  smoke_row "FSDP2, 1 rank, resumed from step 6" fsdp_resume 150 "$R/smoke_fsdp_resumed start_step final_train_loss" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $TINY_CUDA $fsdp \
    resume="$R/smoke_fsdp/checkpoints/step_0000006" hydra.run.dir="$R/smoke_fsdp_resumed"
  rm -rf "$R"/smoke_fsdp/checkpoints "$R"/smoke_fsdp_resumed/checkpoints
}

smoke_llama_rows() {
  local p base=${TINY_CUDA/model=tiny/model=llama-tiny}
  base=${base/precision=bf16 /}
  for p in "bf16" "bf16 compile" "fp8 compile"; do
    local slug=${p// /_} over="precision=${p%% *}"
    [[ $p == *compile ]] && over+=" compile=true"
    smoke_row "model=llama-tiny $p" "llama_$slug" 150 \
      "$R/smoke_llama_$slug knobs.fp8.kept_in_bf16 tokens_per_s_median peak_mem_mib" \
      "$PY" -m perfrun train $base $over hydra.run.dir="$R/smoke_llama_$slug"
  done
}

smoke_estimate_rows() {  # perfrun estimate of a configuration against its measured CUDA peak
  local conf="model=gpt2 data=synthetic dataloader.batch_size=8 device=cuda precision=bf16"
  smoke_row "measured run for the estimate, gpt2 bf16 batch 8, 10 steps" estimate_measured 120 \
    "$R/smoke_estimate_measured peak_mem_mib peak_mem_source" \
    "$PY" -m perfrun train $conf max_steps=10 timing_warmup_steps=3 log_every=5 eval_every=0 eval_batches=1 \
    checkpoint.at_end=false progress=plain hydra.run.dir="$R/smoke_estimate_measured" || return
  if smoke_row "perfrun estimate, gpt2 bf16 batch 8" estimate 120 - "$PY" -m perfrun estimate $conf && ! $DRY; then
    smoke_table_row "estimate against measured" "see detail" "estimate: $(grep -i -m1 'peak' "$R/smoke_estimate.log"); \
measured: $("$PY" scripts/smoke_note.py "$R/smoke_estimate_measured" peak_mem_mib 2>&1)"
  fi
}

ALL="smoke tests gpu-check trainer monitor distributed compile-scope fsdp-cost generate speed speed-knobs speed-tiny \
ladder-gpt2 ladder-tiny starvation speed-loss speed-fp8 speed-fp8-size speed-llama"
SUITES=()
for s in "$@"; do
  if [ "$s" = all ]; then SUITES+=($ALL); continue; fi
  case " $ALL " in *" $s "*) SUITES+=("$s") ;; *) echo "gpu_bench.sh: unknown suite $s; the suites are: $ALL all" >&2; exit 2 ;; esac
done

if $DRY; then  # every python3 call printed (on fd 3, past the suites' redirections), none run
  exec 3>&1
  R=$(mktemp -d) || exit 2
  trap 'rm -rf "$R"' EXIT
  dry_python() {  # each word as the shell reads it back: quoted where it holds a space or a shell character
    local line="python3" a q="'"
    for a in "$@"; do
      if [[ $a =~ [[:space:]\(\)\'\"\;\&\|\<\>\*] ]]; then line+=" '${a//$q/$q\\$q$q}'"; else line+=" $a"; fi
    done
    echo "${line//$R/\$DIR}" >&3
  }
  PY=dry_python
  echo "# gpu_bench.sh --dry-run: from the repository's root, with PYTHONPATH=\$PWD and DIR=$OUT_DIR"
  for s in "${SUITES[@]}"; do
    echo "== $s"
    DIGEST="$R/digest_$s.md"
    "suite_${s//-/_}" 2> /dev/null
  done
  exit 0
fi
R=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd) || exit 2
machine
for s in "${SUITES[@]}"; do
  echo "== $s ($(date -u +%H:%M:%S))"
  DIGEST="$R/digest_$s.md"
  : > "$DIGEST"
  digest_header "$s"
  "suite_${s//-/_}"
  cat "$DIGEST" >> "$R/digest.txt"
done
echo "results in $R (each suite's digest: digest_SUITE.md)"
cat "$R/digest.txt"
