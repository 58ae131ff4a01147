# Next session, on a 4-GPU kind (written in session 24). $1: HEAD's commit, $2: the kind.
# GPU tests at HEAD (the kernel's own-thread MKL sqrt and the learned CPU rate have not run the GPU tests), then the
# planner with the learned CPU rate beside the measurement: every case shares one bandwidth profile, so the first
# case of each rank count is timed and teaches the next (cpu_rate_source says which), host regime at 4 and 1 rank,
# then the disk regime at 4 ranks (2.5 GiB a rank, subgroups of 26M, the node's disk) twice.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -n 1 $R/pytest_gpu.log
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 45 \
  --case "nproc=4 $C" --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=1 $C" --case "nproc=4 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
mkdir -p /var/tmp/scale-tier  # the node's disk (as sessions 19-21)
D="model=1b offload=disk offload.gpu_fraction=0 offload.host_budget_gb=2.5 offload.subgroup_numel=26000384 offload.tiers=[posix:/var/tmp/scale-tier] data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 5 --out $R --log-dir $R/logs/disk --timeout 95 \
  --case "nproc=4 $D" --case "nproc=4 $D" > $R/scale_disk.log 2>&1; echo "disk rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-7s %-7s it %.3f upd %.3f kernel %.3f pred %.3f p/m %.2f pc/k %.2f' % (x['case'][:7], x.get('cpu_rate_source'), x.get('iteration_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_update_s',0), x.get('predicted_over_measured',0), x.get('predicted_cpu_over_kernel') or 0) if 'error' not in x else x['error'][:200])
PY
cp $R/profile.json $R/profile_after.json 2>/dev/null
cd $OUT && tar czf results.tgz r && rm -rf r
