# Session 34, call A ($1: HEAD, $2: kind), one GPU (the 4-GPU kinds were not lent): GPU tests at HEAD (split masters,
# the params' windows); the CPU kernel whole and split on a subgroup of 26M at 4 and 16 threads; then the 1.35B through
# the disk on one GPU, split against whole masters (disk_gpu0 vs disk_gpu0_whole, 8 GiB host, subgroups of 26M), in turns.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; df -h / /dev/shm; grep -i memtotal /proc/meminfo; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
pack
for t in 4 16; do
  timeout 60 python3 scripts/bench_kernels.py --numel 26000384 --threads $t --repeats 5 --device-kind $KIND --out-dir $R > $R/bench_kernels_$t.log 2>&1; echo "kernels $t rc=$?"; tail -7 $R/bench_kernels_$t.log | head -4
done
pack
timeout 300 python3 scripts/bench_peers.py --model 1b --nproc 1 --systems disk_gpu0,disk_gpu0_whole \
  --micro-batches 1 --rounds 1 --steps 3 --warmup-steps 1 --host-budget-gb 8 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk1b --time-budget-s 290 --system-timeout-s 140 > $R/peers_1b.log 2>&1
echo "1b rc=$?"; tail -8 $R/peers_1b.log
