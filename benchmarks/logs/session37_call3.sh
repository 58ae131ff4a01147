# Session 37, call 3 ($1: HEAD; $2: the ranks beside 1, 4 by default; the kind is read from nvidia-smi). GPU tests at
# HEAD; then the 1.35B (seq 2048, micro-batch 1, 8 micro-batches, clipping, host regime gpu_fraction=0) at $2 ranks and
# 1 in turns: the default (model.sum_grads_unsharded=auto: FSDP2 sums the micro-batches unsharded in FP32, one
# reduce-scatter a step) against model.sum_grads_unsharded=false (a reduce-scatter a micro-batch, the optimizer's FP32
# sums); plain FSDP2 (offload=none) at its default (auto) beside.
set -u
source .carry/dev_setup.sh
NEW=$1; NP=${2:-4}
N=$(nvidia-smi -L | wc -l); case "$(nvidia-smi -L | head -1)" in *H200*) KIND=nvidia-h200-x$N;; *H100*) KIND=nvidia-h100-x$N;; *) KIND=unknown-x$N;; esac; echo "kind $KIND"
R=$OUT/r; mkdir -p $R/res
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
T0=$(date +%s)
PYTHONFAULTHANDLER=1 timeout -s ABRT 170 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=5 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
pack
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
H="$B offload=host offload.gpu_fraction=0 offload.bandwidth_profile=$R/p.json"
run() { left=$((480 - $(date +%s) + T0)); [ $left -lt 70 ] && { echo "$1 skipped: ${left}s left"; return; }
  FSDP_OFFLOAD_COMMIT=$NEW timeout $left python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R/res/$1 --log-dir $R/logs/$1 --timeout 90 "${@:2}" >> $R/scale.log 2>&1; echo "$1 rc=$?"; pack; }
run a --case "nproc=$NP $H" --case "nproc=1 $H"
run b --case "nproc=1 $H model.sum_grads_unsharded=false" --case "nproc=$NP $H model.sum_grads_unsharded=false"
run c --case "nproc=$NP $B offload=none" --case "nproc=1 $B offload=none"
run d --case "nproc=1 $H" --case "nproc=$NP $H"
run e --case "nproc=$NP $H model.sum_grads_unsharded=false" --case "nproc=1 $H model.sum_grads_unsharded=false"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for d in sorted(glob.glob(r+'/res/*')):
  for f in sorted(glob.glob(d+'/bench_scale_*.json')):
    rs=json.load(open(f))['runs']
    for x in rs:
        if 'error' in x: print(d[-1], x['error'][:300]); continue
        print('%s n%d %-5s sums %-5s it %.3f med %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f gpu %.1f loss %.4f' % (d[-1], x['nproc'], x['case'].split('offload=')[1][:4], x.get('sum_grads_unsharded'), x['iteration_s'], x['iteration_s_median'], x['forward_s'], x['backward_s'], x.get('update_s') or 0, x.get('exposed_update_s') or 0, x.get('gpu_peak_gib') or 0, x['losses'][-1]))
    ok=[x for x in rs if 'error' not in x]
    if len(ok)==2:
        one=[x for x in ok if x['nproc']==1][0]; many=[x for x in ok if x['nproc']>1][0]
        print('   per GPU: mean %.1f%%  median %.1f%%' % (100*one['iteration_s']/many['iteration_s'], 100*one['iteration_s_median']/many['iteration_s_median']))
PY
