# Session 32, call 2 ($1: HEAD, $2: kind). Call 1's disk regime again at 4 ranks (1.35B, mb 1, clipping, 2.5 GiB host a
# rank, subgroups of 26M): multipath (the node's disk and /dev/shm, its shm RAM counted) first, then ZeRO-Infinity
# (it logged nothing in 152 s in call 1: now 260 s, its stacks dumped if stopped), then every byte through the disk.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt
timeout 545 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems multipath_gpu0,zero_infinity,disk_gpu0 \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 1 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs/disk --time-budget-s 535 --system-timeout-s 260 > $R/peers_disk.log 2>&1
echo "disk rc=$?"; tail -16 $R/peers_disk.log
grep -h -A3 "set up in\|Thread 0x\|File " $R/logs/disk/*/zero_infinity.log | grep -v "^\s*$" | head -40
