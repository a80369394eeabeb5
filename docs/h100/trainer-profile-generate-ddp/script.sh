#!/usr/bin/env bash
# On an H100: TF32 check, GPU tests, bench_train, profiled run, generate, DDP(nccl) vs plain.
set -uo pipefail
R=/tmp/results; mkdir -p "$R"
export PERFRUN_CACHE=${PERFRUN_CACHE:-/tmp/perfrun-cache} COLUMNS=160
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/timeline.txt"; }
pack() {  # files <= 5 MiB into the tarball; a listing of everything
  (cd "$R" && find . -type f -printf '%s\t%p\n' | sort -k2 > file_listing.txt \
   && find . -type f -size -5121k | sort > /tmp/tarlist && tar czf "${RESULTS:-results}.tgz" -T /tmp/tarlist)
}
el start
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  python3 -c "import sys,torch,hydra;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'cudnn',torch.backends.cudnn.version(),'hydra',hydra.__version__)"; } > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"
el tf32; timeout 120 python3 - > "$R/tf32_check.txt" 2>&1 <<'PY'
import torch
m = torch.backends.cuda.matmul
def show(tag):
    fp = getattr(m, "fp32_precision", "<no attribute>")
    print(f"{tag}: allow_tf32={m.allow_tf32} fp32_precision={fp} float32_matmul_precision={torch.get_float32_matmul_precision()}")
show("default")
m.allow_tf32 = False; show("after allow_tf32=False")
n = 8192; a = torch.randn(n, n, device="cuda"); b = torch.randn(n, n, device="cuda")
def tflops(reps=10):
    for _ in range(3): a @ b
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    ts.sort(); return 2 * n**3 / ts[len(ts) // 2] / 1e12
off = tflops(); print(f"fp32 8192^2 matmul, allow_tf32=False: {off:.1f} TFLOPS (median of 10)")
m.allow_tf32 = True; show("after allow_tf32=True")
on = tflops(); print(f"fp32 8192^2 matmul, allow_tf32=True: {on:.1f} TFLOPS (median of 10)")
m.allow_tf32 = False; show("after allow_tf32=False again")
off2 = tflops(); print(f"fp32 8192^2 matmul, allow_tf32=False again: {off2:.1f} TFLOPS (median of 10)")
print(f"RESULT tf32_off={off:.1f} tf32_on={on:.1f} off_again={off2:.1f} ratio_on_off={on/off:.2f}")
PY
echo "tf32 rc=$?" >> "$R/tf32_check.txt"; cat "$R/tf32_check.txt"
el pytest; timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rA > "$R/pytest_gpu.txt" 2>&1; echo "pytest -m gpu rc=$?" >> "$R/pytest_gpu.txt"; tail -4 "$R/pytest_gpu.txt"; pack
el bench; timeout 200 python3 scripts/bench_train.py --steps 50 --warmup 15 --repeats 1 --json "$R/bench_train_gpt2.json" \
  model=gpt2 data=synthetic dataloader.batch_size=16 device=cuda precision=bf16 compile=true > "$R/bench_train_gpt2.txt" 2>&1
echo "bench rc=$?" >> "$R/bench_train_gpt2.txt"; tail -5 "$R/bench_train_gpt2.txt"; pack
el profiled; timeout 150 python3 -m perfrun train model=gpt2 data=pysource dataloader.batch_size=8 device=cuda precision=bf16 max_steps=30 \
  profile=true memory_snapshot=true progress=plain checkpoint.at_end=true hydra.run.dir="$R/profiled_run" > "$R/profiled_run.txt" 2>&1
echo "profiled rc=$?" >> "$R/profiled_run.txt"; tail -3 "$R/profiled_run.txt"
timeout 60 python3 - > "$R/trace_check.txt" 2>&1 <<'PY'
import glob, gzip, json, os, pickle, collections
d = "/tmp/results/profiled_run"
for p in sorted(glob.glob(d + "/**", recursive=True)):
    if os.path.isfile(p): print(f"{os.path.getsize(p):>12,d}  {os.path.relpath(p, d)}")
t = glob.glob(d + "/profile/trace.json*")[0]
j = json.load(gzip.open(t) if t.endswith(".gz") else open(t))
ev = j["traceEvents"] if isinstance(j, dict) else j
cats = collections.Counter(e.get("cat") for e in ev)
print("trace parses:", t, "events", len(ev)); print("categories:", dict(cats.most_common(12)))
k = collections.Counter(); kd = collections.Counter()
for e in ev:
    if e.get("cat") == "kernel": k[e["name"][:90]] += 1; kd[e["name"][:90]] += e.get("dur", 0)
print("CUDA kernel events:", sum(k.values()), "distinct kernels:", len(k))
for n, us in kd.most_common(8): print(f"  {us/1e3:9.2f} ms  x{k[n]:<4d} {n}")
s = glob.glob(d + "/memory_snapshot.pickle")
if s:
    snap = pickle.load(open(s[0], "rb")); print("memory snapshot:", s[0], "segments", len(snap["segments"]), "device_traces entries", sum(len(x) for x in snap["device_traces"]))
else: print("memory snapshot: NOT FOUND")
PY
cat "$R/trace_check.txt" | head -40; cp "$R/profiled_run/profile/top_ops.txt" "$R/top_ops.txt" 2>/dev/null; pack
el generate; CK=$(ls "$R"/profiled_run/checkpoints/step_*.pt | tail -1); echo "checkpoint $CK"
timeout 90 python3 -m perfrun generate checkpoint="$CK" device=cuda prompt="def main(" max_new_tokens=200 > "$R/gen_cache.txt" 2> "$R/gen_cache.err"; echo "rc=$?" >> "$R/gen_cache.err"
timeout 90 python3 -m perfrun generate checkpoint="$CK" device=cuda prompt="def main(" max_new_tokens=200 cache=false > "$R/gen_nocache.txt" 2> "$R/gen_nocache.err"; echo "rc=$?" >> "$R/gen_nocache.err"
cat "$R"/gen_*.err; if cmp -s "$R/gen_cache.txt" "$R/gen_nocache.txt"; then echo "generated text: IDENTICAL" | tee "$R/gen_compare.txt"; else echo "generated text: DIFFERENT" | tee "$R/gen_compare.txt"; fi
rm -f "$R"/profiled_run/checkpoints/*.pt.tmp*; pack
el ddp; timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m perfrun train distributed=ddp model=gpt2 data=synthetic \
  dataloader.batch_size=16 device=cuda precision=bf16 max_steps=60 progress=plain checkpoint.at_end=false hydra.run.dir="$R/ddp_nccl_run" > "$R/ddp_nccl_run.txt" 2>&1
echo "ddp rc=$?" >> "$R/ddp_nccl_run.txt"; tail -3 "$R/ddp_nccl_run.txt"
el plain; timeout 120 python3 -m perfrun train model=gpt2 data=synthetic \
  dataloader.batch_size=16 device=cuda precision=bf16 max_steps=60 progress=plain checkpoint.at_end=false hydra.run.dir="$R/plain_run" > "$R/plain_run.txt" 2>&1
echo "plain rc=$?" >> "$R/plain_run.txt"; tail -3 "$R/plain_run.txt"
el end; pack
python3 - <<'PY' 2>&1 | tee "$R/summary_table.txt"
import json
def L(p):
    try: return json.load(open(p))
    except Exception as e: return {"_err": str(e)}
b = L("/tmp/results/bench_train_gpt2.json"); print(f"bench_train ratio perfrun/plain: {b.get('ratio')}  perfrun {b.get('perfrun_tokens_per_s')} plain {b.get('plain_tokens_per_s')}")
rows = {}
for n in ("profiled_run", "ddp_nccl_run", "plain_run"):
    s = L(f"/tmp/results/{n}/summary.json"); rows[n] = s
    k = s.get("knobs", {})
    print(f"{n:14s} status={s.get('status')} world={s.get('world_size')} ddp_backend={k.get('ddp_backend', k.get('distributed'))} tok/s={s.get('tokens_per_s_median')} mfu={s.get('mfu_median')} peak_MiB={s.get('peak_mem_mib')} steady={s.get('steady_steps')}")
try: print("DDP(nccl)/plain tokens/s ratio:", rows["ddp_nccl_run"]["tokens_per_s_median"] / rows["plain_run"]["tokens_per_s_median"])
except Exception as e: print("ratio n/a", e)
PY
pack; cat "$R/timeline.txt"
