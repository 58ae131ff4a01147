# Session 30, call 2 ($1: HEAD, $2: kind, $3: ranks; the 4-GPU kinds were not lent, so 2 ranks). The GPU tests at HEAD (the unit-at-a-time grad hand-over: batched norms and
# copies); the hooks' cost a param, 991daa6 (its package first on PYTHONPATH) and HEAD in turns; 4/1-rank host-regime
# pairs (N/1 ranks; 1.35B, seq 2048, mb 1, clip, defaults), 991daa6 and HEAD in turns, one bandwidth profile each (first case timed).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
OLD=$PWD/.carry/old991
for v in old new old new; do
  if [ $v = old ]; then PP=$OLD; C=991daa6; else PP=; C=$1; fi
  FSDP_OFFLOAD_COMMIT=$C PYTHONPATH=$PP timeout 80 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --steps 60 --out $R/hook_$v > $R/hook_cost_$v.log 2>&1; echo "hook $v rc=$?"; tail -1 $R/hook_cost_$v.log
done
S="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
for v in old new old new; do
  if [ $v = old ]; then PP=$OLD; C=991daa6; else PP=; C=$1; fi
  FSDP_OFFLOAD_COMMIT=$C PYTHONPATH=$PP timeout 100 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R/scale_$v --log-dir $R/logs/$v --timeout 45 \
    --case "nproc=$3 $S offload.bandwidth_profile=$R/profile_$v.json" --case "nproc=1 $S offload.bandwidth_profile=$R/profile_$v.json" >> $R/scale_$v.log 2>&1; echo "scale $v rc=$?"
done
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for v in ('old','new'):
    for f in sorted(glob.glob(r+f'/scale_{v}/bench_scale_*.json')):
        d=json.load(open(f))
        for x in d['runs']:
            if 'error' in x: print(v, x['error'][:300]); continue
            print('%s %s %d it %.3f fwd %.3f bwd %.3f upd %.3f p/m %.2f %s' % (v, d.get('commit'), x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['predicted_over_measured'], x['cpu_rate_source']))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
