# Session 31, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD (the first GPU run of session 30's work after 58f080f);
# 4/1-rank host-regime pairs (1.35B, seq 2048, mb 1, clip, a fresh profile: first case timed, then learned), the
# planner's re-timing on a busy node; each rank's CPU update one thread short of its share of the cores (a core left
# for the launching threads) in turns with the default.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=15 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
pack
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 330 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 75 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C train.cpu_threads=15" --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=1 $C train.cpu_threads=63" > $R/scale_host.log 2>&1; echo "host rc=$?"
pack
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        print('%d %d it %.3f fwd %.3f bwd %.3f upd %.3f kern %.3f p/m %.2f %s %s | %s' % (i, x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x.get('cpu_kernel_s') or 0, x['predicted_over_measured'], x['cpu_rate_source'], x['case'].split()[-1], (x.get('cpu_rate_detail') or '')[:120]))
PY
