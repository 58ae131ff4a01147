# session 21, call 1: GPU tests at HEAD (model-load hooks, overlap hyperparameter check, reduce_dtype notice:
# CPU-only so far), the planner's CPU-rate timing spread, the real update at 1 and 4 ranks.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
mkdir -p $OUT/logs
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/pytest_gpu.log
timeout 120 python3 .carry/s21_rate_probe.py > $OUT/rate_probe.log 2>&1; echo "probe rc=$?"; cat $OUT/rate_probe.log | tail -8
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $OUT --log-dir $OUT/logs/scale --timeout 90 \
  --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=2 $C" > $OUT/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
out=os.environ['OUT']
for f in sorted(glob.glob(out+'/bench_scale_*.json')):
    for r in json.load(open(f))['runs']:
        print('%-20s it %.3f upd %.3f pred %.3f p/m %.2f rate %.0f' % (r['case'][:8], r.get('iteration_s',0), r.get('update_s',0), r.get('predicted_update_s',0), r.get('predicted_over_measured',0), r.get('cpu_mparams_per_s',0)) if 'error' not in r else r['error'][:200])
PY
cd $OUT && tar czf logs.tgz logs && rm -rf logs
