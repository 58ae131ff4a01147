# Session 34, call D ($1: HEAD, $2: kind), 4 H200s of one node (lent again late in the session): GPU tests at HEAD, with
# DeepSpeed's ops built beside them; then the 1.35B at 4 ranks in the disk regime, every byte of state through the node's
# one disk (gpu_fraction=0, subgroups of 26M, 2.5 GiB host a rank, clipping): split masters (disk_gpu0, auto's choice),
# whole (disk_gpu0_whole), and ZeRO-Infinity on the same disk, in one call.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; df -h / /dev/shm; grep -i memtotal /proc/meminfo; uptime; } > $R/cards.txt
( t0=$(date +%s)
  timeout 200 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder; CPUAdamBuilder().load(); AsyncIOBuilder().load()" > $R/ds_build.log 2>&1
  echo "ds build rc=$? in $(( $(date +%s) - t0 )) s" >> $R/ds_build.log ) &
BUILD=$!
PYTHONFAULTHANDLER=1 timeout -s ABRT 170 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=5 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
wait $BUILD; tail -1 $R/ds_build.log
pack
timeout 340 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems disk_gpu0,disk_gpu0_whole,zero_infinity \
  --micro-batches 1 --rounds 1 --steps 3 --warmup-steps 1 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk1b --time-budget-s 330 --system-timeout-s 150 > $R/peers_1b.log 2>&1
echo "1b rc=$?"; tail -12 $R/peers_1b.log
