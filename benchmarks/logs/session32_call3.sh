# Session 32, call 3 ($1: HEAD, $2: kind). Multipath (the node's disk and /dev/shm) beside ZeRO-Infinity at the same
# host peak: call 2's multipath held 16.2 GiB of RSS + 8.1 GiB on /dev/shm against ZeRO-Infinity's 21.2, so here its
# host budget is 1.5 GiB a rank (1.35B, 4 ranks, mb 1, clipping, subgroups of 26M), in one call with ZeRO-Infinity.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt
timeout 470 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems multipath_gpu0,zero_infinity \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 1.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 1 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk --time-budget-s 460 --system-timeout-s 280 > $R/peers_disk.log 2>&1
echo "disk rc=$?"; tail -12 $R/peers_disk.log
