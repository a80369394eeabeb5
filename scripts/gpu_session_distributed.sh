#!/usr/bin/env bash
# The distributed checks for a lent one-GPU machine (see ../shared/device/README.md): the
# GPU tests of DDP and FSDP over NCCL, the wrapper-cost benchmark (plain vs DDP vs FSDP2,
# eager and compiled), an FSDP run through torchrun that saves sharded checkpoints and a
# resume of it, and a sweep over distributed=none,ddp,fsdp. Results: $OUT/results.tgz.
set -uo pipefail
R=/tmp/results; mkdir -p "$R"
export PERFRUN_CACHE=/tmp/perfrun-cache COLUMNS=160
nvidia-smi -L | tee "$R/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$R/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fsdp.py tests/test_distributed.py > "$R/pytest_gpu_distributed.txt" 2>&1
echo "pytest -m gpu (distributed) rc=$?" | tee -a "$R/gpu.txt"
GPT2="model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16"
python3 scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_distributed_eager.json" $GPT2 > "$R/bench_distributed_eager.txt" 2>&1
python3 scripts/bench_distributed.py --steps 60 --warmup 15 --json "$R/bench_distributed_compile.json" $GPT2 compile=true > "$R/bench_distributed_compile.txt" 2>&1
python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $GPT2 distributed=fsdp max_steps=40 \
  monitor.every_n_steps=10 progress=plain checkpoint.every_n_steps=20 hydra.run.dir="$R/fsdp_nccl" > "$R/fsdp_nccl.txt" 2>&1
echo "fsdp nccl rc=$?" | tee -a "$R/gpu.txt"
python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train $GPT2 distributed=fsdp max_steps=40 \
  monitor.every_n_steps=10 progress=plain resume="$R/fsdp_nccl/checkpoints/step_0000020" hydra.run.dir="$R/fsdp_resumed" > "$R/fsdp_resumed.txt" 2>&1
echo "fsdp resume rc=$?" | tee -a "$R/gpu.txt"
du -sh "$R"/fsdp_nccl/checkpoints/* | tee -a "$R/gpu.txt"
rm -rf "$R"/fsdp_nccl/checkpoints "$R"/fsdp_resumed/checkpoints
python3 -m perfrun train -m distributed=none,ddp,fsdp $GPT2 max_steps=40 checkpoint.at_end=false progress=plain \
  hydra.sweep.dir="$R/sweep" > "$R/sweep.txt" 2>&1
echo "sweep rc=$?" | tee -a "$R/gpu.txt"
tar czf "$OUT/results.tgz" -C "$R" .
tail -3 "$R/pytest_gpu_distributed.txt"; tail -5 "$R/bench_distributed_eager.txt"; tail -5 "$R/bench_distributed_compile.txt"
grep -h "done:" "$R/fsdp_nccl.txt" "$R/fsdp_resumed.txt"; grep -A8 "perfrun: runs" "$R/sweep.txt"
