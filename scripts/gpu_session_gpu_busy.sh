#!/usr/bin/env bash
# One GPU call: GPU-busy share of profiled steps (scripts/trace_gpu_busy.py), none vs ddp vs fsdp.
set -uo pipefail
R=/tmp/results5; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=160
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"
for mode in none ddp fsdp; do
  python3 -m perfrun train $GPT2 distributed=$mode max_steps=16 profile=true profiler.start_step=10 \
    checkpoint.at_end=false progress=plain monitor.every_n_steps=0 hydra.run.dir="$R/prof_$mode" > "$R/prof_$mode.txt" 2>&1
done
python3 scripts/trace_gpu_busy.py "$R"/prof_{none,ddp,fsdp}/profile/trace.json > "$R/gpu_busy.txt" 2>&1
python3 -c "
import json
for m in ('none','ddp','fsdp'):
    ev=json.load(open('$R/prof_'+m+'/profile/trace.json'))['traceEvents']
    print(m, sorted({(e.get('cat'), e['name'][:14]) for e in ev if str(e.get('name','')).startswith('ProfilerStep')}))
" >> "$R/gpu_busy.txt" 2>&1
rm -rf "$R"/prof_*/profile/tensorboard "$R"/prof_*/checkpoints
gzip "$R"/prof_*/profile/trace.json
tar czf "$OUT/results.tgz" -C "$R" .
cat "$R/gpu_busy.txt"; grep -h "done:" "$R"/prof_*.txt
