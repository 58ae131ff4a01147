# Session 29, call 6 ($1: HEAD, $2: kind). One more 4/1-rank host-regime pair (1.35B, seq 2048, mb 1, clip, defaults, a
# fresh profile: timed first runs), the plan's rate note now saying where the node was busy while it timed the rate.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 offload=host offload.gpu_fraction=0 $P"
timeout 125 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 60 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        print('%d %d it %.3f bwd %.3f upd %.3f p/m %.2f %s kern %.3f/%.3f note: %s' % (i, x['nproc'], x['iteration_s'], x['backward_s'], x['update_s'], x['predicted_over_measured'], x['cpu_rate_source'], x['cpu_kernel_s'], x['predicted_cpu_s'], x['cpu_rate_detail'][:200]))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
