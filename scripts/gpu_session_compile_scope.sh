#!/usr/bin/env bash
# one GPU call: all GPU tests; compile scope model vs blocks under none/ddp/fsdp (one rank)
set -uo pipefail
R=/tmp/results3; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=160
python3 -m pytest -m gpu -q -p no:cacheprovider > "$R/pytest_gpu_all.txt" 2>&1; echo "pytest -m gpu rc=$?" | tee "$R/gpu.txt"
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16 compile=true"
for scope in model blocks; do
  python3 scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_distributed_compile_$scope.json" $GPT2 compile_options.scope=$scope > "$R/bench_distributed_compile_$scope.txt" 2>&1
done
tar czf "$OUT/results.tgz" -C "$R" .
tail -4 "$R/pytest_gpu_all.txt"; tail -5 "$R"/bench_distributed_compile_model.txt; tail -5 "$R"/bench_distributed_compile_blocks.txt
