# Session 33, call 3 ($1: HEAD, $2: kind), on calls 1-2's machine while warm: the 7B at 4 ranks, this product at
# ZeRO-Infinity's host peak (call 2: 40.2 GiB): disk_gpu0 behind 8 GiB a rank (call 1's 2.5 GiB gave 16.2 GiB), and
# the disk recipe with its defaults (gpu_fraction=auto: the planner keeps what fits on the GPUs).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
{ nvidia-smi -L; uptime; } > $R/cards.txt
timeout 330 python3 scripts/bench_peers.py --model 7b --nproc 4 --systems disk_gpu0 \
  --micro-batches 1 --rounds 1 --steps 2 --warmup-steps 1 --host-budget-gb 8 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs --time-budget-s 320 --system-timeout-s 300 > $R/peers_7b_gpu0.log 2>&1
echo "gpu0 rc=$?"; tail -6 $R/peers_7b_gpu0.log
pack
timeout 200 python3 scripts/bench_peers.py --model 7b --nproc 4 --systems disk \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 8 \
  --raw-io-gib 0 --device-kind $KIND --out $R --log-dir $R/logs --time-budget-s 190 --system-timeout-s 180 > $R/peers_7b_defaults.log 2>&1
echo "defaults rc=$?"; tail -6 $R/peers_7b_defaults.log
