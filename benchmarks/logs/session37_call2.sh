# Session 37, call 2 ($1: HEAD). An experiment on a patched copy of the tree (.carry/s37_exp_patch.py): the 1.35B (seq
# 2048, micro-batch 1, 8 micro-batches, clipping) at $2 ranks (4 by default) and 1 in turns, the product in the host regime
# (gpu_fraction=0) and plain FSDP2, each with FSDP2's gradient sync every micro-batch (today) and on the last one only
# (EXP_ONCE: FSDP2 sums the micro-batches in FP32, one reduce-scatter a step).
set -u
source .carry/dev_setup.sh
NEW=$1; NP=${2:-4}
N=$(nvidia-smi -L | wc -l); case "$(nvidia-smi -L | head -1)" in *H200*) KIND=nvidia-h200-x$N;; *H100*) KIND=nvidia-h100-x$N;; *) KIND=unknown-x$N;; esac; echo "kind $KIND"
R=$OUT/r; mkdir -p $R/res
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
rm -rf /tmp/exp && mkdir /tmp/exp && cp -r fsdp_offload scripts pyproject.toml /tmp/exp/ && python3 .carry/s37_exp_patch.py /tmp/exp || exit 1
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
H="$B offload=host offload.gpu_fraction=0 offload.bandwidth_profile=$R/p.json"
run() { (cd /tmp/exp && FSDP_OFFLOAD_COMMIT=$NEW PYTHONPATH=/tmp/exp timeout 200 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R/res/$1 --log-dir $R/logs/$1 --timeout 90 "${@:2}" >> $R/scale.log 2>&1); echo "$1 rc=$?"; pack; }
run a --case "nproc=$NP $H" --case "nproc=1 $H"
EXP_ONCE=1 run b --case "nproc=1 $H offload.micro_batches=1" --case "nproc=$NP $H offload.micro_batches=1"
EXP_ONCE=1 run c --case "nproc=$NP $B offload=none" --case "nproc=1 $B offload=none"
run d --case "nproc=1 $B offload=none" --case "nproc=$NP $B offload=none"
EXP_ONCE=1 run e --case "nproc=$NP $H offload.micro_batches=1" --case "nproc=1 $H offload.micro_batches=1"
run f --case "nproc=1 $H" --case "nproc=$NP $H"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for d in sorted(glob.glob(r+'/res/*')):
  for f in sorted(glob.glob(d+'/bench_scale_*.json')):
    rs=json.load(open(f))['runs']
    for x in rs:
        if 'error' in x: print(d[-1], x['error'][:300]); continue
        print('%s n%d %-5s it %.3f med %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f gpu %.1f loss %s' % (d[-1], x['nproc'], x['case'].split('offload=')[1][:4], x['iteration_s'], x['iteration_s_median'], x['forward_s'], x['backward_s'], x.get('update_s') or 0, x.get('exposed_update_s') or 0, x.get('gpu_peak_gib') or 0, x['losses'][-1]))
    ok=[x for x in rs if 'error' not in x]
    if len(ok)==2:
        one=[x for x in ok if x['nproc']==1][0]; four=[x for x in ok if x['nproc']>1][0]
        print('   per GPU: mean %.1f%%  median %.1f%%' % (100*one['iteration_s']/four['iteration_s'], 100*one['iteration_s_median']/four['iteration_s_median']))
PY
