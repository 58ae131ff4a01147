# session 22, call 5 (2-GPU kind): the step's update split: the CPU kernel timed inside the step (cpu_kernel_s)
# beside the planner's CPU time and the whole update, host regime, 1 and 2 ranks, two rounds.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 240 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 50 \
  --case "nproc=1 $C" --case "nproc=2 $C" --case "nproc=1 $C" --case "nproc=2 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-7s it %.3f upd %.3f kernel %.3f pred_cpu %.3f pred/upd %.2f pred_cpu/kernel %.2f' % (x['case'][:7], x.get('iteration_s',0), x.get('update_s',0), x.get('cpu_kernel_s',0), x.get('predicted_cpu_s',0), x.get('predicted_over_measured',0), x.get('predicted_cpu_over_kernel',0)) if 'error' not in x else x['error'][:200])
PY
for d in $R/logs/scale/case*; do python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$d/metrics.jsonl')][1:]
print('$d'.split('/')[-1], 'upd', [round(r['update_s'],3) for r in rows][:4], 'kern', [round(r['cpu_kernel_s'],3) for r in rows][:4], 'norm', [round(r['norm_s'],4) for r in rows][:3])"; done
cd $OUT && tar czf results.tgz r && rm -rf r
