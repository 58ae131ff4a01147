# Session 29, call 4 ($1: HEAD, $2: kind). The disk regime at 4 ranks against a sustained disk limit: bench_peers'
# disk_gpu0 (1.35B, seq 2048, mb 1, clipping, 2.5 GiB of host memory a rank, subgroups of 26M, every byte of state
# through the node's one disk), with the raw disk measured over 12 GiB (write, read, both at once; one sample each)
# just before and just after, the volume of about one step's traffic (12.5 GB), not a 2 GiB burst.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 420 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems disk_gpu0 --micro-batches 1 --rounds 1 --steps 4 \
  --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 --raw-io-gib 12 --raw-io-samples 1 \
  --device-kind $KIND --out $R --log-dir $R/logs/peers --time-budget-s 400 --system-timeout-s 300 > $R/peers_disk.log 2>&1; echo "disk rc=$?"
tail -25 $R/peers_disk.log | cut -c1-250
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_peers_*.json')):
    for name, s in json.load(open(f))['runs'].items():
        print(name, {k: s.get(k) for k in ('iteration_s','disk_bytes_per_step','raw_mixed_io_gbps','raw_mixed_io_after_gbps','physical_limit_s','physical_limit_after_s')})
PY
cd $OUT && tar czf results.tgz r && rm -rf r
