#!/usr/bin/env bash
# One GPU call: the profiler GPU test, and profile=true under distributed=none and fsdp with
# the GPU-busy figure in the summary and the host's top operators (top_ops_cpu.txt).
set -uo pipefail
R=/tmp/results6; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=200
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_profiling.py > "$R/pytest_gpu_profiling.txt" 2>&1
echo "pytest rc=$?" > "$R/gpu.txt"
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"
for mode in none fsdp; do
  python3 -m perfrun train $GPT2 distributed=$mode max_steps=16 profile=true profiler.start_step=10 \
    checkpoint.at_end=false progress=plain monitor.every_n_steps=0 hydra.run.dir="$R/prof_$mode" > "$R/prof_$mode.txt" 2>&1
  cp "$R/prof_$mode/profile/top_ops_cpu.txt" "$R/top_ops_cpu_$mode.txt"
  python3 -c "import json; print('$mode', json.load(open('$R/prof_$mode/summary.json'))['knobs']['profile'])" >> "$R/gpu.txt"
done
rm -rf "$R"/prof_*/profile "$R"/prof_*/checkpoints
tar czf "$OUT/results.tgz" -C "$R" .
cat "$R/gpu.txt"; tail -2 "$R/pytest_gpu_profiling.txt"; grep -h "GPU ran kernels" "$R"/prof_*.txt
