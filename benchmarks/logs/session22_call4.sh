# session 22, call 4 (2-GPU kind): call 3 found the update's kernel 7-31% slower beside a busy launching thread, and
# not slower at 15 threads a rank with one beside it. Does the step's update (and step) gain when the update leaves
# the forward's launching thread a core (or two)? Host regime, 1 rank at 32/31/30 threads and 2 ranks at 16/15/14,
# interleaved, two rounds, the planner's prediction beside each.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
CASES=()
for round in 1 2; do
  for t in 32 31 30; do CASES+=(--case "nproc=1 $C train.cpu_threads=$t"); done
  for t in 16 15 14; do CASES+=(--case "nproc=2 $C train.cpu_threads=$t"); done
done
timeout 480 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 50 "${CASES[@]}" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-7s %-3s it %.3f fwd %.3f bwd %.3f upd %.3f pred %.3f p/m %.2f' % (x['case'][:7], x['case'].split('cpu_threads=')[1], x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('predicted_update_s',0), x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
