# Session 30, call 3 ($1: HEAD, $2: kind, $3: ranks), on call 2's warm machine (call 2 ran out of its 600 s before it
# packed its records): N/1-rank host-regime pairs (1.35B, seq 2048, mb 1, clip, defaults), HEAD and 991daa6 (its
# package first on PYTHONPATH) in turns, one bandwidth profile each; the records packed as each pair ends.
set -u
python3 -c "import fsdp_offload" 2>/dev/null || source .carry/dev_setup.sh
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }
trap pack EXIT
nvidia-smi -L > $R/cards.txt
OLD=$PWD/.carry/old991
S="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
for v in new old new old; do
  if [ $v = old ]; then PP=$OLD; C=991daa6; else PP=; C=$1; fi
  FSDP_OFFLOAD_COMMIT=$C PYTHONPATH=$PP timeout 110 python3 scripts/bench_scale.py --device-kind $2 --steps 8 --out $R/scale_$v --log-dir $R/logs/$v --timeout 50 \
    --case "nproc=$3 $S offload.bandwidth_profile=$R/profile_$v.json" --case "nproc=1 $S offload.bandwidth_profile=$R/profile_$v.json" >> $R/scale_$v.log 2>&1; echo "scale $v rc=$?"
  pack
done
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for v in ('old','new'):
    for f in sorted(glob.glob(r+f'/scale_{v}/bench_scale_*.json')):
        d=json.load(open(f))
        for x in d['runs']:
            if 'error' in x: print(v, x['error'][:300]); continue
            print('%s %s %d it %.3f fwd %.3f bwd %.3f upd %.3f p/m %.2f %s' % (v, d.get('commit'), x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['predicted_over_measured'], x['cpu_rate_source']))
PY
