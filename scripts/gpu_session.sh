#!/usr/bin/env bash
# What to run on a lent GPU machine (see ../shared/device/README.md): the GPU tests,
# gpu-check, the trainer benchmark (gpt2, bf16, compile), a monitored training run and
# the monitor-overhead benchmark. Results go to $OUT/results.tgz; a short table is printed last.
set -uo pipefail
R=/tmp/results; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=160
nvidia-smi -L | tee "$R/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$R/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider > "$R/pytest_gpu.txt" 2>&1; echo "pytest -m gpu rc=$?" | tee -a "$R/gpu.txt"
python3 -m perfrun gpu-check --json > "$R/gpucheck.json" 2> "$R/gpucheck.err"; echo "gpu-check rc=$?" | tee -a "$R/gpu.txt"
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda"
python3 scripts/bench_train.py --steps 50 --warmup 15 --repeats 1 --json "$R/bench_train_gpt2.json" $GPT2 precision=bf16 compile=true > "$R/bench_train_gpt2.txt" 2>&1
python3 -m perfrun train $GPT2 precision=bf16 compile=true max_steps=150 monitor.every_n_steps=10 \
  checkpoint.at_end=false progress=plain hydra.run.dir="$R/monitored_run" > "$R/monitored_run.txt" 2>&1
python3 scripts/bench_monitor.py --steps 60 --warmup 10 --repeats 2 --json "$R/bench_monitor.json" \
  model=gpt2 data=synthetic dataloader.batch_size=8 device=cuda precision=bf16 > "$R/bench_monitor.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$R" .
tail -3 "$R/pytest_gpu.txt"; tail -6 "$R/bench_train_gpt2.txt"; tail -2 "$R/bench_monitor.txt"; grep done "$R/monitored_run.txt"
