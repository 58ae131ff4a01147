# Session 27, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD (the commits since eb9c3d3 ran on no GPU); the 1-rank
# fixed-cost probe (.carry/s27_probe.py: the update's fixed costs timed in-process, after CUDA work, in a subprocess,
# at 16 threads, with OMP_WAIT_POLICY=passive); then bench_scale host regime with the recipe's defaults at 4,1,4,1 ranks,
# one shared bandwidth profile (the first case of each rank count times the CPU rate, the next learn it).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" $R/pytest_gpu.log | tail -2
for v in inproc cuda subprocess t16; do timeout 60 python3 .carry/s27_probe.py $v >> $R/probe.log 2>&1; done
OMP_WAIT_POLICY=passive timeout 60 python3 .carry/s27_probe.py inproc >> $R/probe.log 2>&1
grep PROBE $R/probe.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l.split('PROBE ',1)[1]); print('%-10s omp=%-7s thr=%2d rate=%5.0f sg=%.3f call=%.3f tr=%.3f step=%.3f walk14=%.4f'%(r['variant'],r['env_omp'],r['threads'],r['rate_mps'],r['subgroup_ms'],r['call_ms'],r['transfer_ms'],r['step_ms'],r['walk14_s']))"
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 60 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%d AC=%-5s %-7s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f pred %.3f walk %.3f p/m %.2f gpu %.1f/%.1f' % (x['nproc'], x.get('activation_checkpointing'), x.get('cpu_rate_source'), x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['exposed_update_s'], x['predicted_update_s'], x.get('predicted_walk_s') or 0, x['predicted_over_measured'], x['gpu_peak_gib'], x['predicted_gpu_train_gib']) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
