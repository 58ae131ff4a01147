# Session 28, call 2 ($1: HEAD, $2: kind). bench_scale's host regime (1.35B, seq 2048, mb 1, clipping) with the recipes'
# defaults, now model.reshard_after_forward: auto (the units kept gathered here) beside activation_checkpointing: auto:
# 4 and 1 ranks in turns, three pairs, one shared bandwidth profile (the first case of each rank count times the CPU
# rate, later ones learn it). Then the timed-rate probe (.carry/s28_rate_probe.py) beside the rates the runs saved.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 350 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 150 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" \
  > $R/scale_host.log 2>&1; echo "host rc=$?"
timeout 90 python3 .carry/s28_rate_probe.py $R/profile.json > $R/rate_probe.log 2>&1; echo "probe rc=$?"
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        rows=[json.loads(l) for l in open(f"{r}/logs/host/case{i}/metrics.jsonl")]
        med=statistics.median(q['step_s'] for q in rows[2:])
        print('%d ckpt=%s raf=%s it %.3f (med %.3f) fwd %.3f bwd %.3f upd %.3f kern %.3f/%.3f gpu %.1f p/m %.2f %s loss %.4f->%.4f' % (x['nproc'], x['activation_checkpointing'], x['reshard_after_forward'], x['iteration_s'], med, x['forward_s'], x['backward_s'], x['update_s'], x['cpu_kernel_s'], x['predicted_cpu_s'], x['gpu_peak_gib'], x['predicted_over_measured'], x['cpu_rate_source'], x['losses'][0], x['losses'][-1]))
PY
grep -h "PROBE\|PROFILE" $R/rate_probe.log | cut -c1-400
cd $OUT && tar czf results.tgz r && rm -rf r
