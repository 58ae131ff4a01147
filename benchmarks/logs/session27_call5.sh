# Session 27, call 5 (1-rank pair again, the order swapped; no GPU test) ($1: HEAD, $2: kind). The new train.compile (each block's math compiled by inductor): its GPU test,
# then bench_scale's host regime (1.35B, seq 2048, mb 1, clipping, recipe defaults) eager against compiled, at 4 and 1
# ranks, in turns, one shared bandwidth profile. Steps after the first are bench_scale's mean; the first step (compiling)
# and the median of steps 2+ are printed from each case's metrics.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 150 \
  --case "nproc=1 $C train.compile=true" --case "nproc=1 $C" \
  > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        rows=[json.loads(l) for l in open(f"{r}/logs/host/case{i}/metrics.jsonl")]
        med=statistics.median(q['step_s'] for q in rows[2:])
        print('%d compile=%-5s it %.3f (median 2+ %.3f, first %.1f) fwd %.3f bwd %.3f upd %.3f loss %.4f->%.4f' % (x['nproc'], 'compile=true' in x['case'], x['iteration_s'], med, rows[0]['step_s'], x['forward_s'], x['backward_s'], x['update_s'], x['losses'][0], x['losses'][-1]))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
