# session 23, call 2 (2-GPU kind): why the planner's timed kernel runs 8-35% faster than the step's (call 1: planner
# CPU time over in-step kernel 0.74-0.80 at 1 rank, 0.83-0.92 at 2). Hypothesis: the planner reuses one 0.9 GB set of
# state every round, part of which a large last-level cache keeps; a step meets each subgroup's state once.
# bench_update_gap's `cold` variant cycles through 3 sets. Then the step's own kernel at 1 and 2 ranks, same machine.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
lscpu | grep -i -E "model name|cache|^CPU\(s\)|numa" | tee $R/lscpu.txt
for f in /sys/devices/system/cpu/cpu0/cache/index*/size; do echo "$f $(cat $f)"; done | tee -a $R/lscpu.txt
cat /sys/kernel/mm/transparent_hugepage/enabled | tee -a $R/lscpu.txt
G="--rounds 8 --repeat 2 --variants planner,cold --device-kind $KIND --out $R"
timeout 100 python3 scripts/bench_update_gap.py --ranks 1 --threads 32 --numel 67108864 $G 2>&1 | tee $R/gap1.log | tail -5
timeout 100 python3 scripts/bench_update_gap.py --ranks 2 --threads 16 --numel 67108864 $G 2>&1 | tee $R/gap2.log | tail -5
timeout 100 python3 scripts/bench_update_gap.py --ranks 1 --threads 32 --numel 16777216 --cold-sets 12 $G 2>&1 | tee $R/gap1s.log | tail -5
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 120 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 50 \
  --case "nproc=1 $C" --case "nproc=2 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-8s upd %.3f kernel %.3f pred_cpu %.3f cpu/kernel %.2f p/m %.2f' % (x['case'][:7], x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_cpu_s',0), x.get('predicted_cpu_over_kernel') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
