# session 21, call 4: per-GPU scaling 1 -> 4 ranks at micro-batch 1, three interleaved rounds each of GPU-only
# FSDP2 and the host regime (all state in host memory), so the machines' noise shows in the spread.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
mkdir -p $OUT/logs
for n in 1 4; do
timeout 270 python3 scripts/bench_peers.py --model 1b --nproc $n --systems gpu_only,host_gpu0 --micro-batches 1 --rounds 3 --steps 10 --warmup-steps 2 \
  --device-kind $KIND --out $OUT --log-dir $OUT/logs/peers$n --time-budget-s 260 --system-timeout-s 80 > $OUT/bench_peers_n$n.log 2>&1
echo "nproc=$n rc=$?"
done
python3 - <<'PY'
import json,glob,os
out=os.environ['OUT']
for f in sorted(glob.glob(out+'/bench_peers_*.json')):
    d=json.load(open(f))
    for k,r in d['runs'].items(): print(os.path.basename(f), k, r.get('nproc'), 'it', r.get('iteration_s'), 'rounds', r.get('round_iteration_s'), 'tok/s', r.get('tokens_per_s'))
PY
cd $OUT && tar czf logs.tgz logs && rm -rf logs
