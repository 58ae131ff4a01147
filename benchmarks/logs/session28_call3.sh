# Session 28, call 3 ($1: HEAD, $2: kind). GPU tests at HEAD; the timed-rate probe 2 (.carry/s28_rate_probe2.py);
# then bench_scale's host regime (1.35B, seq 2048, mb 1, clipping, recipe defaults: activations and gathered units
# kept) with train.compile=true at 4 and 1 ranks, the bandwidth profile shared (both timed).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/pytest_gpu.log
timeout 100 python3 .carry/s28_rate_probe2.py > $R/rate_probe2.log 2>&1; echo "probe rc=$?"
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P train.compile=true"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 100 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        rows=[json.loads(l) for l in open(f"{r}/logs/host/case{i}/metrics.jsonl")]
        med=statistics.median(q['step_s'] for q in rows[2:])
        print('%d compile ckpt=%s raf=%s it %.3f (med %.3f, first %.1f) fwd %.3f bwd %.3f upd %.3f kern %.3f/%.3f gpu %.1f p/m %.2f %s loss %.4f->%.4f' % (x['nproc'], x['activation_checkpointing'], x['reshard_after_forward'], x['iteration_s'], med, rows[0]['step_s'], x['forward_s'], x['backward_s'], x['update_s'], x['cpu_kernel_s'], x['predicted_cpu_s'], x['gpu_peak_gib'], x['predicted_over_measured'], x['cpu_rate_source'], x['losses'][0], x['losses'][-1]))
PY
grep -h "FACTS\|PROBE" $R/rate_probe2.log | cut -c1-300
cd $OUT && tar czf results.tgz r && rm -rf r
