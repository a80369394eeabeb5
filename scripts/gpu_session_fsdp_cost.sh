#!/usr/bin/env bash
# One GPU call: where FSDP2's one-rank cost goes (GPU busy share in a profiler trace, none
# vs ddp vs fsdp), reshard_after_forward true vs false, and the cost on a larger model.
set -uo pipefail
R=/tmp/results4; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=160
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"
python3 scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_reshard.json" \
  --modes none,fsdp,fsdp+fsdp.reshard_after_forward=false $GPT2 > "$R/bench_reshard.txt" 2>&1
python3 scripts/bench_distributed.py --steps 40 --warmup 10 --json "$R/bench_medium.json" \
  model=gpt2-medium data=synthetic dataloader.batch_size=8 device=cuda precision=bf16 > "$R/bench_medium.txt" 2>&1
for mode in none ddp fsdp; do
  python3 -m perfrun train $GPT2 distributed=$mode max_steps=16 profile=true profiler.start_step=10 \
    checkpoint.at_end=false progress=plain monitor.every_n_steps=0 hydra.run.dir="$R/prof_$mode" > "$R/prof_$mode.txt" 2>&1
  cp "$R/prof_$mode/profile/top_ops.txt" "$R/top_ops_$mode.txt"
done
python3 scripts/trace_gpu_busy.py "$R"/prof_none/profile/trace.json "$R"/prof_ddp/profile/trace.json \
  "$R"/prof_fsdp/profile/trace.json > "$R/gpu_busy.txt" 2>&1
rm -rf "$R"/prof_*/profile "$R"/prof_*/checkpoints
tar czf "$OUT/results.tgz" -C "$R" .
tail -5 "$R/bench_reshard.txt"; tail -5 "$R/bench_medium.txt"; cat "$R/gpu_busy.txt"
