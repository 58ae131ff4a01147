# Session 26, call 3 ($1: HEAD, $2: kind). GPU tests at HEAD; then the host regime (1.35B, seq 2048, mb 1, clipping) with
# the recipe's default activation checkpointing (auto: resolved off here) against it on, in turns at 4 and 1 ranks, one
# shared bandwidth profile (the first case of each rank count times the CPU rate, the next learn it). Recorded after each case.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" $R/pytest_gpu.log | tail -2
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
A="model.activation_checkpointing=true"
timeout 260 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 60 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C $A" --case "nproc=1 $C $A" --case "nproc=4 $C" --case "nproc=1 $C" \
  > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        ac = x.get('activation_checkpointing')
        print('%d AC=%-5s %-7s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f pred %.3f p/m %.2f gpu %.1f/%.1f' % (x['nproc'], ac, x.get('cpu_rate_source'), x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['exposed_update_s'], x['predicted_update_s'], x['predicted_over_measured'], x['gpu_peak_gib'], x['predicted_gpu_train_gib']) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
