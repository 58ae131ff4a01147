# Session 35, call 3 ($1: HEAD, $2: kind, $3: the commit before the change). Tokens/s per GPU at 4 ranks and at 1 the
# way the recipes train (session 33's call 4 setting: 1.35B, seq 2048, micro-batch 1, 8 micro-batches, clipping, host
# regime with gpu_fraction=0), with the FSDP2 units kept gathered between micro-batches (HEAD) and without (a copy of
# the tree with the previous train_step.py, .carry/s35_old_train_step.py), in turns; plain FSDP2 (offload=none, HEAD's
# loop) at 4 and 1 beside them; the planner's prediction per case.
set -u
source .carry/dev_setup.sh
NEW=$1; KIND=$2; OLD=$3
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r fsdp_offload scripts pyproject.toml /tmp/old/ && cp .carry/s35_old_train_step.py /tmp/old/fsdp_offload/train_step.py
PYTHONPATH=/tmp/old python3 -c "import fsdp_offload.train_step as t; print('old:', t.__file__, hasattr(t, 'gathered_between_micro_batches'))"
python3 -c "import fsdp_offload.train_step as t; print('new:', t.__file__, hasattr(t, 'gathered_between_micro_batches'))"
P="offload.bandwidth_profile=$R/profile.json"
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
C="$B offload=host offload.gpu_fraction=0 $P"
new() { FSDP_OFFLOAD_COMMIT=$NEW timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 6 --out $R/new --log-dir $R/logs/new$1 --timeout 90 "${@:2}" >> $R/scale_new.log 2>&1; echo "new $1 rc=$?"; }
old() { (cd /tmp/old && FSDP_OFFLOAD_COMMIT=$OLD PYTHONPATH=/tmp/old timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 6 --out $R/old --log-dir $R/logs/old$1 --timeout 90 "${@:2}" >> $R/scale_old.log 2>&1); echo "old $1 rc=$?"; }
mkdir -p $R/new $R/old
new a --case "nproc=4 $C" --case "nproc=1 $C"
old a --case "nproc=4 $C" --case "nproc=1 $C"
new b --case "nproc=4 $C" --case "nproc=1 $C"
old b --case "nproc=4 $C" --case "nproc=1 $C"
new c --case "nproc=4 $B offload=none" --case "nproc=1 $B offload=none"
pack
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/*/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(f[-30:], i, x['error'][:300]); continue
        print('%s n%d %s it %.3f fwd %.3f bwd %.3f upd %s pred/meas %s' % (f.split('/')[-2], x['nproc'], x['case'].split('offload=')[1][:4], x['iteration_s'], x['forward_s'], x['backward_s'], x.get('update_s'), x.get('predicted_over_measured')))
PY
