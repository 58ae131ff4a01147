# session 21, call 5: GPU tests at HEAD (the grad norms written as FP32 norms, one kernel a grad), then the host
# regime at 4 and 1 ranks, HEAD against 5dde663 (its fsdp_offload first on PYTHONPATH), interleaved.
set -u
source .carry/dev_setup.sh
NEW=$1; KIND=$2
mkdir -p $OUT/logs
export FSDP_OFFLOAD_COMMIT=$NEW
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -1 $OUT/pytest_gpu.log
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
i=0
for spec in "4 new" "4 old" "4 new" "4 old" "1 new" "1 old"; do
  set -- $spec; n=$1; v=$2; i=$((i+1))
  if [ $v = old ]; then export PYTHONPATH=$PWD/.carry/old_5dde663 FSDP_OFFLOAD_COMMIT=5dde663; else unset PYTHONPATH; export FSDP_OFFLOAD_COMMIT=$NEW; fi
  python3 -c "import fsdp_offload, sys; print('$v', fsdp_offload.__file__)"
  timeout 75 python3 scripts/bench_scale.py --device-kind $KIND --steps 10 --out $OUT --log-dir $OUT/logs/ab$i --timeout 70 --case "nproc=$n $C" > $OUT/ab$i.log 2>&1; echo "ab$i $spec rc=$?"
  sleep 1
done
unset PYTHONPATH
python3 - <<'PY'
import json,glob,os
out=os.environ['OUT']
for f in sorted(glob.glob(out+'/bench_scale_*.json')):
    d=json.load(open(f))
    for r in d['runs']:
        print('%s %-8s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f p/m %.2f' % (d['commit'][:7], r['case'][:7], r.get('iteration_s',0), r.get('forward_s',0), r.get('backward_s',0), r.get('update_s',0), r.get('exposed_update_s',0), r.get('predicted_over_measured',0)) if 'error' not in r else r['error'][:200])
PY
cd $OUT && tar czf logs.tgz logs && rm -rf logs
