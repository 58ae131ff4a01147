# session 22, call 1 (2-GPU kind; the 4-GPU kinds are not lent today): GPU tests at HEAD (3a13cba's HeldGrad spec,
# fb1d55e's staging pieces and the trial's fixes never ran on a GPU), then the planner's prediction beside the
# measured update at 1 and 2 ranks (host regime) and 2 ranks on the node's one disk: the issue's re-run of the
# 2-GPU NCCL case with the planner that times the CPU as the node's ranks run it. One tarball back.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs /var/tmp/scale-tier
nproc --all; free -g | head -2; grep -E "MemTotal|MemAvailable" /proc/meminfo; cat /sys/fs/cgroup/memory.max 2>/dev/null
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -8 $R/pytest_gpu.log
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 60 \
  --case "nproc=1 $C" --case "nproc=2 $C" --case "nproc=1 $C" --case "nproc=2 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
D="model=1b offload=disk offload.gpu_fraction=0 offload.host_budget_gb=2.5 offload.subgroup_numel=26000384 offload.tiers=[posix:/var/tmp/scale-tier] data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 130 python3 scripts/bench_scale.py --device-kind $KIND --steps 5 --out $R --log-dir $R/logs/scale_disk --timeout 120 \
  --case "nproc=2 $D" > $R/scale_disk.log 2>&1; echo "disk rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-8s %-5s it %.3f fwd %.3f bwd %.3f upd %.3f pred %.3f p/m %.2f' % (x['case'][:7], x['case'].split()[2][8:], x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('predicted_update_s',0), x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
