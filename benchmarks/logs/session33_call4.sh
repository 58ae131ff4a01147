# Session 33, call 4 ($1: HEAD, $2: kind). Tokens/s per GPU at 4 ranks and at 1, the way the recipes train: 8
# micro-batches a step accumulated (1.35B, seq 2048, micro-batch 1, clipping), host regime (gpu_fraction=0) in
# turns 4/1/4/1, and plain FSDP2 on the GPU (offload=none) at 4 and 1 beside them; the planner's prediction per case.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
C="$B offload=host offload.gpu_fraction=0 $P"
timeout 470 python3 scripts/bench_scale.py --device-kind $KIND --steps 6 --out $R --log-dir $R/logs --timeout 90 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" \
  --case "nproc=4 $B offload=none" --case "nproc=1 $B offload=none" > $R/scale.log 2>&1; echo "scale rc=$?"
pack
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        tps = x.get('tokens_per_s')
        print('%d n%d it %.3f fwd %.3f bwd %.3f upd %s pred/meas %s %s tok/s %s' % (i, x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x.get('update_s'), x.get('predicted_over_measured'), x.get('cpu_rate_source'), tps))
PY
