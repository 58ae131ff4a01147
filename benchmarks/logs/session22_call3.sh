# session 22, call 3 (2-GPU kind): why the step's CPU update runs 13-18% slower than the planner's timed kernel
# (call 1: predicted over measured 0.82-0.87). The kernel in four settings (bench_update_gap.py) at 1 rank of 32
# threads and 2 of 16, interleaved, then the host regime at 2 ranks for the step's own update beside it.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
timeout 150 python3 scripts/bench_update_gap.py --ranks 2 --threads 16 --numel 67108864 --rounds 8 --repeat 2 --device-kind $KIND --out $R 2>&1 | tee $R/gap2.log | tail -9
timeout 60 python3 scripts/bench_update_gap.py --ranks 2 --threads 15 --numel 67108864 --rounds 8 --repeat 2 --variants planner,with_launcher --device-kind $KIND --out $R 2>&1 | tee $R/gap2t15.log | tail -5
timeout 100 python3 scripts/bench_update_gap.py --ranks 1 --threads 32 --numel 67108864 --rounds 8 --repeat 2 --device-kind $KIND --out $R 2>&1 | tee $R/gap1.log | tail -9
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 100 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 60 \
  --case "nproc=2 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-8s upd %.3f pred %.3f p/m %.2f rate %.0f' % (x['case'][:7], x.get('update_s',0), x.get('predicted_update_s',0), x.get('predicted_over_measured',0), x.get('cpu_mparams_per_s',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
