# Session 32, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD (nothing after 97f0f76 had run on a GPU); then the disk
# regime at 4 ranks, 1.35B, mb 1, clipping, 2.5 GiB host a rank, subgroups of 26M: ZeRO-Infinity on the node's disk,
# this product every byte through that disk, and multipath (that disk and /dev/shm), its shm RAM counted.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt; df -h / /dev/shm >> $R/cards.txt; grep -i memtotal /proc/meminfo >> $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=15 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
pack
timeout 340 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems zero_infinity,disk_gpu0,multipath_gpu0 \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --device-kind $KIND --out $R --log-dir $R/logs/disk --time-budget-s 330 --system-timeout-s 150 > $R/peers_disk.log 2>&1
echo "disk rc=$?"; tail -14 $R/peers_disk.log
