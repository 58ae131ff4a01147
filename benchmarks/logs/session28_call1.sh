# Session 28, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD; then bench_scale's host regime (1.35B, seq 2048, mb 1,
# clipping, recipe defaults) with model.reshard_after_forward true (FSDP2's default) against false, at 4 and 1 ranks,
# in turns, one shared bandwidth profile (the first case of each rank count times the CPU rate, the later ones learn
# it and, at 4 ranks, its steps' walk).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/pytest_gpu.log
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
F="model.reshard_after_forward=false"
timeout 330 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 150 \
  --case "nproc=4 $C" --case "nproc=4 $C $F" --case "nproc=1 $C" --case "nproc=1 $C $F" --case "nproc=4 $C" --case "nproc=4 $C $F" \
  > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        rows=[json.loads(l) for l in open(f"{r}/logs/host/case{i}/metrics.jsonl")]
        med=statistics.median(q['step_s'] for q in rows[2:])
        pk=max(q.get('gpu_peak_gib',0) for q in rows)
        print('%d raf=%-5s it %.3f (med %.3f) fwd %.3f bwd %.3f upd %.3f kern %s gpu %.1f p/m %s %s loss %.4f->%.4f' % (x['nproc'], 'reshard_after_forward=false' not in x['case'], x['iteration_s'], med, x['forward_s'], x['backward_s'], x['update_s'], x.get('cpu_kernel_s'), pk, x.get('predicted_over_measured'), x.get('cpu_rate_source'), x['losses'][0], x['losses'][-1]))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
