# session 21, call 3: does a smaller CPU team a rank (the update is memory-bound) leave the launching
# threads more, at 1 and 4 ranks, interleaved, two rounds? Then the disk regime at 4 ranks with the planner beside it.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
mkdir -p $OUT/logs /var/tmp/scale-tier
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 380 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $OUT --log-dir $OUT/logs/scale --timeout 60 \
  --case "nproc=4 $C" --case "nproc=4 $C train.cpu_threads=8" --case "nproc=4 $C train.cpu_threads=4" \
  --case "nproc=1 $C" --case "nproc=1 $C train.cpu_threads=32" --case "nproc=1 $C train.cpu_threads=16" \
  --case "nproc=4 $C train.cpu_threads=4" --case "nproc=4 $C train.cpu_threads=8" --case "nproc=4 $C" \
  --case "nproc=1 $C train.cpu_threads=16" --case "nproc=1 $C train.cpu_threads=32" --case "nproc=1 $C" > $OUT/scale.log 2>&1; echo "scale rc=$?"
D="model=1b offload=disk offload.gpu_fraction=0 offload.host_budget_gb=2.5 offload.subgroup_numel=26000384 offload.tiers=[posix:/var/tmp/scale-tier] data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 5 --out $OUT --log-dir $OUT/logs/scale_disk --timeout 140 \
  --case "nproc=4 $D" > $OUT/scale_disk.log 2>&1; echo "disk rc=$?"
python3 - <<'PY'
import json,glob,os
out=os.environ['OUT']
for f in sorted(glob.glob(out+'/bench_scale_*.json')):
    for r in json.load(open(f))['runs']:
        print('%-8s %-22s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f pred %.3f p/m %.2f' % (r['case'][:7], r['case'].split('warmup_steps=1')[1][:22], r.get('iteration_s',0), r.get('forward_s',0), r.get('backward_s',0), r.get('update_s',0), r.get('exposed_update_s',0), r.get('predicted_update_s',0), r.get('predicted_over_measured',0)) if 'error' not in r else r['error'][:200])
PY
cd $OUT && tar czf logs.tgz logs && rm -rf logs
