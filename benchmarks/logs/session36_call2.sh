# Session 36, call 2 ($1: HEAD, $2: kind, $3: the commit before the change, $4: ranks). The 1.35B, seq 2048, micro-batch 1,
# 8 micro-batches, clipping, host regime (gpu_fraction=0), at $4 ranks and 1: HEAD (one add a unit for later micro-batches)
# against a copy of the tree with the previous staging.py, grad_sums.py and held_grad.py (.carry/s36_old), in turns;
# plain FSDP2 beside them. First the GPU tests of grad accumulation.
set -u
source .carry/dev_setup.sh
NEW=$1; KIND=$2; OLD=$3; NP=$4
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 120 python3 -m pytest -m gpu tests/test_grad_accumulation_gpu.py tests/test_unit_grads.py -q -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
rm -rf /tmp/old && mkdir /tmp/old && cp -r fsdp_offload scripts pyproject.toml /tmp/old/ && cp .carry/s36_old/*.py /tmp/old/fsdp_offload/
(cd /tmp/old && PYTHONPATH=/tmp/old python3 -c "import fsdp_offload.train_step as t; print('old:', t.__file__, open(t.__file__.replace('train_step','staging')).read().count('_storage_start'))")
python3 -c "import fsdp_offload.train_step as t; print('new:', t.__file__, open(t.__file__.replace('train_step','staging')).read().count('_storage_start'))"
P="offload.bandwidth_profile=$R/profile.json"
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
C="$B offload=host offload.gpu_fraction=0 $P"
new() { FSDP_OFFLOAD_COMMIT=$NEW timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 6 --out $R/new --log-dir $R/logs/new$1 --timeout 90 "${@:2}" >> $R/scale_new.log 2>&1; echo "new $1 rc=$?"; }
old() { (cd /tmp/old && FSDP_OFFLOAD_COMMIT=$OLD PYTHONPATH=/tmp/old timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 6 --out $R/old --log-dir $R/logs/old$1 --timeout 90 "${@:2}" >> $R/scale_old.log 2>&1); echo "old $1 rc=$?"; }
mkdir -p $R/new $R/old
new a --case "nproc=$NP $C" --case "nproc=1 $C"
old a --case "nproc=$NP $C" --case "nproc=1 $C"
new b --case "nproc=$NP $C" --case "nproc=1 $C"
old b --case "nproc=$NP $C" --case "nproc=1 $C"
new c --case "nproc=$NP $B offload=none" --case "nproc=1 $B offload=none"
pack
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/*/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(f[-30:], i, x['error'][:300]); continue
        print('%s n%d %s it %.3f fwd %.3f bwd %.3f upd %s pred/meas %s' % (f.split('/')[-2], x['nproc'], x['case'].split('offload=')[1][:4], x['iteration_s'], x['forward_s'], x['backward_s'], x.get('update_s'), x.get('predicted_over_measured')))
PY
