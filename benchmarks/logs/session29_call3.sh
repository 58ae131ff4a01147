# Session 29, call 3 ($1: HEAD, $2: kind). #31's host-regime scaling with its control, in one bench_scale record: the
# 1.35B (seq 2048, mb 1, clipping, recipe defaults), this product (offload=host, gpu_fraction=0) and plain FSDP2
# (offload=none: torch's fused AdamW on the GPU, units kept gathered as this product's default keeps them), each at 4
# ranks and at 1, in turns, twice; a fresh bandwidth profile, so each rank count's first product run is a timed first
# run of the planner on this machine and the second a learned one.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
S="model=1b data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
C="$S offload=host offload.gpu_fraction=0 $P"
G="$S offload=none model.reshard_after_forward=false"
timeout 470 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 80 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $G" --case "nproc=1 $G" \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $G" --case "nproc=1 $G" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        plain = 'offload=none' in x['case']
        print('%d %s %d it %.3f fwd %.3f bwd %.3f upd %.3f gpu %.1f %s' % (i, 'fsdp2' if plain else 'prod ', x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['gpu_peak_gib'],
              '' if plain else 'p/m %.2f %s kern %.3f/%.3f' % (x['predicted_over_measured'], x['cpu_rate_source'], x['cpu_kernel_s'], x['predicted_cpu_s'])))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
