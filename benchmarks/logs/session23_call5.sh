# session 23, call 5 (2-GPU kind): GPU tests at the session's last code, then the host regime at 1 and 2 ranks once
# more (the planner's prediction and cpu_kernel_s beside each, a third machine of the kind).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/pytest_gpu.log
grep -E "^FAILED" $R/pytest_gpu.log | head -5
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 120 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 50 \
  --case "nproc=1 $C" --case "nproc=2 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-8s it %.3f upd %.3f kernel %.3f pred_cpu %.3f cpu/kernel %.2f p/m %.2f' % (x['case'][:7], x.get('iteration_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_cpu_s',0), x.get('predicted_cpu_over_kernel') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
