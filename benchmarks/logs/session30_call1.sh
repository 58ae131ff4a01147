# Session 30, call 1 ($1: HEAD, $2: kind). The GPU tests at HEAD (the first GPU run of session 29's closing work);
# the CPU cost of each op a grad hook runs (probe, log only); the hooks' cost a param (bench_hook_cost, cuda); a 4/1
# rank host-regime pair twice (1.35B, seq 2048, mb 1, clip, defaults, a fresh profile).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=15 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
timeout 60 python3 .carry/s30_hook_ops_probe.py > $R/hook_ops_probe.log 2>&1; echo "probe rc=$?"; cat $R/hook_ops_probe.log | tail -12
timeout 90 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --out $R > $R/hook_cost.log 2>&1; echo "hook cost rc=$?"; tail -1 $R/hook_cost.log
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 220 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 60 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        print('%d %d it %.3f fwd %.3f bwd %.3f upd %.3f p/m %.2f %s' % (i, x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['predicted_over_measured'], x['cpu_rate_source']))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
