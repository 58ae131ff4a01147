# Session 33, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD (the tier lock's gate of session 32 has not run on a GPU);
# beside them DeepSpeed's cpu_adam and async_io ops are built once into $OUT (carried to later machines: a fresh
# machine spent ~105 s building them before ZeRO-Infinity's first step); then the 7B in the disk regime at 4 ranks,
# this product alone (disk_gpu0: every byte of state through the node's disk, 2.5 GiB host a rank, subgroups of 26M),
# to learn its start-up and step before the call that runs it beside ZeRO-Infinity.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; pwd; df -h / /dev/shm; grep -i memtotal /proc/meminfo; python3 -c "import sys; print(sys.version)"; } > $R/cards.txt
( export TORCH_EXTENSIONS_DIR=$R/torch_ext; t0=$(date +%s)
  timeout 300 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder; CPUAdamBuilder().load(); AsyncIOBuilder().load()" > $R/ds_build.log 2>&1
  echo "ds build rc=$? in $(( $(date +%s) - t0 )) s" >> $R/ds_build.log ) &
BUILD=$!
PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
wait $BUILD; tail -1 $R/ds_build.log; du -sh $R/torch_ext
pack
timeout 330 python3 scripts/bench_peers.py --model 7b --nproc 4 --systems disk_gpu0 \
  --micro-batches 1 --rounds 1 --steps 2 --warmup-steps 1 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk7b --time-budget-s 320 --system-timeout-s 300 > $R/peers_7b.log 2>&1
echo "7b rc=$?"; tail -8 $R/peers_7b.log; grep -h -E "set up in|startup|plan: update" -r $R/logs/disk7b | head -6
