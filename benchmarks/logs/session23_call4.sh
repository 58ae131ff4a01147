# session 23, call 4 (2-GPU kind): call 3's disk regime again, ZeRO-Infinity given 320 s (in call 3 it did 1 of 4
# steps in 154 s, most of it start-up). 1.35B, 2.5 GiB host a rank, subgroups of 26M, the node's one disk, clipping.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
timeout 450 python3 scripts/bench_peers.py --model 1b --nproc 2 --systems disk_gpu0,zero_infinity \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --device-kind $KIND --out $R --log-dir $R/logs/disk --time-budget-s 440 --system-timeout-s 320 > $R/peers_disk.log 2>&1
echo "disk rc=$?"; tail -7 $R/peers_disk.log
cd $OUT && tar czf results.tgz r && rm -rf r
