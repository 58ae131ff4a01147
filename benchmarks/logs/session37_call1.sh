# Session 37, call 1 ($1: HEAD; the kind is read from nvidia-smi). GPU tests at HEAD; then the 1.35B (seq 2048, micro-batch 1, 8 micro-batches,
# clipping, host regime gpu_fraction=0) at 4 ranks and 1 in turns: the default CPU threads (cores / ranks) against one
# core a rank left to the training loop (cores / ranks - 1), and train.compile=true.
set -u
source .carry/dev_setup.sh
NEW=$1
N=$(nvidia-smi -L | wc -l); case "$(nvidia-smi -L | head -1)" in *H200*) KIND=nvidia-h200-x$N;; *H100*) KIND=nvidia-h100-x$N;; *) KIND=unknown-x$N;; esac; echo "kind $KIND"
R=$OUT/r; mkdir -p $R/res
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA'; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=5 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
pack
C=$(nproc); T1=$((C-1)); T4=$((C/4-1))
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1 offload=host offload.gpu_fraction=0"
run() { FSDP_OFFLOAD_COMMIT=$NEW timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R/res --log-dir $R/logs/$1 --timeout 90 "${@:2}" >> $R/scale.log 2>&1; echo "$1 rc=$?"; pack; }
PA="offload.bandwidth_profile=$R/pa.json"; PB="offload.bandwidth_profile=$R/pb.json"
run a --case "nproc=4 $B $PA" --case "nproc=1 $B $PA"
run b --case "nproc=1 $B $PB train.cpu_threads=$T1" --case "nproc=4 $B $PB train.cpu_threads=$T4"
run c --case "nproc=4 $B $PA train.compile=true" --case "nproc=1 $B $PA train.compile=true"
run d --case "nproc=1 $B $PA" --case "nproc=4 $B $PA"
run e --case "nproc=4 $B $PB train.cpu_threads=$T4" --case "nproc=1 $B $PB train.cpu_threads=$T1"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/res/bench_scale_*.json')):
    rs=json.load(open(f))['runs']
    for x in rs:
        if 'error' in x: print(f[-20:-5], x['error'][:300]); continue
        print('%s n%d %-40s it %.3f med %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f' % (f[-20:-5], x['nproc'], x['case'][x['case'].find('gpu_fraction=0')+15:][:40], x['iteration_s'], x['iteration_s_median'], x['forward_s'], x['backward_s'], x.get('update_s') or 0, x.get('exposed_update_s') or 0))
    ok=[x for x in rs if 'error' not in x]
    if len(ok)==2:
        one=[x for x in ok if x['nproc']==1][0]; four=[x for x in ok if x['nproc']==4][0]
        print('   per GPU: mean %.1f%%  median %.1f%%' % (100*one['iteration_s']/four['iteration_s'], 100*one['iteration_s_median']/four['iteration_s_median']))
PY
