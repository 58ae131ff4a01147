# Session 35, call 1 (session 34 call 1, run again) ($1: HEAD, $2: kind). Split masters (bf16 params: 10 bytes a param off the GPU, not 12).
# GPU tests at HEAD; DeepSpeed's ops built meanwhile (for call 2 on this machine); then the 7B at 4 ranks in the disk
# regime, this product alone: disk_gpu0 behind 8 GiB a rank, subgroups of 26M (session 33's setting); before it, the CPU kernel
# whole and split on one subgroup of 26M with a rank's 4 threads.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; df -h / /dev/shm; grep -i memtotal /proc/meminfo; uptime; } > $R/cards.txt
( t0=$(date +%s)
  timeout 300 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder; CPUAdamBuilder().load(); AsyncIOBuilder().load()" > $R/ds_build.log 2>&1
  echo "ds build rc=$? in $(( $(date +%s) - t0 )) s" >> $R/ds_build.log ) &
BUILD=$!
PYTHONFAULTHANDLER=1 timeout -s ABRT 240 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
wait $BUILD; tail -1 $R/ds_build.log
pack
timeout 100 python3 scripts/bench_kernels.py --numel 26000384 --threads 4 --repeats 5 --device-kind $KIND --out-dir $R > $R/bench_kernels.log 2>&1; echo "kernels rc=$?"; tail -7 $R/bench_kernels.log
timeout 300 python3 scripts/bench_peers.py --model 7b --nproc 4 --systems disk_gpu0 \
  --micro-batches 1 --rounds 1 --steps 2 --warmup-steps 1 --host-budget-gb 8 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk7b --time-budget-s 290 --system-timeout-s 280 > $R/peers_7b.log 2>&1
echo "7b rc=$?"; tail -8 $R/peers_7b.log; grep -h -E "plan: update|cache" -r $R/logs/disk7b | head -4
