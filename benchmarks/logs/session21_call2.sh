# session 21, call 2: GPU tests at HEAD (300 s), the planner's prediction (CPU rate timed as teams) beside the
# host regime at 1, 2 and 4 ranks, and the disk regime at 4 ranks on the node's one disk.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
mkdir -p $OUT/logs
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $OUT --log-dir $OUT/logs/scale --timeout 90 \
  --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=2 $C" --case "nproc=4 $C" > $OUT/scale.log 2>&1; echo "scale rc=$?"
D="model=1b offload=disk offload.gpu_fraction=0 offload.host_budget_gb=2.5 offload.subgroup_numel=26000384 offload.tiers=[posix:/var/tmp/scale-tier] data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 5 --out $OUT --log-dir $OUT/logs/scale_disk --timeout 140 \
  --case "nproc=4 $D" > $OUT/scale_disk.log 2>&1; echo "disk rc=$?"
python3 - <<'PY'
import json,glob,os
out=os.environ['OUT']
for f in sorted(glob.glob(out+'/bench_scale_*.json')):
    for r in json.load(open(f))['runs']:
        print('%-30s it %.3f upd %.3f pred %.3f p/m %.2f rate %.0f' % (r['case'][:30], r.get('iteration_s',0), r.get('update_s',0), r.get('predicted_update_s',0), r.get('predicted_over_measured',0), r.get('cpu_mparams_per_s',0)) if 'error' not in r else r['error'][:200])
PY
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 > $OUT/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -14 $OUT/pytest_gpu.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
