# Session 29, call 5 ($1: HEAD, $2: kind). The disk's own sustained limit, no product running: bench_io's mixed load
# (4 threads, 8 MiB requests, as the disk tier's defaults; a 12 GiB file) held 60 s, a 15 s rest, held 60 s again,
# GB/s a 5 s window; call 4's disk_gpu0 moved 1.64 GB/s against 2.28 before and 1.60 after. Then one more 4/1-rank
# host-regime pair (1.35B, seq 2048, mb 1, clip, defaults, a fresh profile: a timed first run of the planner).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 200 python3 scripts/bench_io.py --dir /var/tmp --threads 4 --request-mib 8 --gib 12 --no-sweep --sustained-s 60 --rest-s 15 \
  --window-s 5 --device-kind $KIND --out $R > $R/io.log 2>&1; echo "io rc=$?"; tail -30 $R/io.log | cut -c1-200
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 offload=host offload.gpu_fraction=0 $P"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 70 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(i, x['error'][:300]); continue
        print('%d %d it %.3f fwd %.3f bwd %.3f upd %.3f p/m %.2f %s kern %.3f/%.3f' % (i, x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['predicted_over_measured'], x['cpu_rate_source'], x['cpu_kernel_s'], x['predicted_cpu_s']))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
