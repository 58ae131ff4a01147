# Session 36, call 3 ($1: HEAD, $2: kind). Tokens/s per GPU at 4 ranks and at 1, the way the recipes train (the 1.35B, seq
# 2048, micro-batch 1, 8 micro-batches, clipping, host regime with gpu_fraction=0), at HEAD (a unit's later micro-batch
# grads added in one add): 4 ranks and 1 in turns, three times, 8 steps each; plain FSDP2 (offload=none) at 4 and 1 beside.
set -u
source .carry/dev_setup.sh
NEW=$1; KIND=$2
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
C="$B offload=host offload.gpu_fraction=0 $P"
run() { FSDP_OFFLOAD_COMMIT=$NEW timeout 240 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R/res --log-dir $R/logs/$1 --timeout 100 "${@:2}" >> $R/scale.log 2>&1; echo "$1 rc=$?"; pack; }
mkdir -p $R/res
run a --case "nproc=4 $C" --case "nproc=1 $C"
run b --case "nproc=1 $C" --case "nproc=4 $C"
run c --case "nproc=4 $C" --case "nproc=1 $C"
run p --case "nproc=4 $B offload=none" --case "nproc=1 $B offload=none"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/res/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(f[-30:], i, x['error'][:300]); continue
        print('%s n%d %s it %.3f med %.3f fwd %.3f bwd %.3f upd %s pred/meas %s' % (f[-20:-5], x['nproc'], x['case'].split('offload=')[1][:4], x['iteration_s'], x['iteration_s_median'], x['forward_s'], x['backward_s'], x.get('update_s'), x.get('predicted_over_measured')))
PY
