# session 23, call 3 (2-GPU kind): #31's side-by-side at the ranks lent (2): the disk regime against ZeRO-Infinity
# (1.35B, 2.5 GiB host a rank, subgroups of 26M, the node's one disk; as session 19's 4-rank call) and the host regime
# (all state in host memory) against ZeRO-Offload; clipping at 1.0, seq 2048, micro-batch 1.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
timeout 300 python3 scripts/bench_peers.py --model 1b --nproc 2 --systems disk_gpu0,zero_infinity \
  --micro-batches 1 --rounds 1 --steps 4 --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 \
  --raw-io-gib 2 --device-kind $KIND --out $R --log-dir $R/logs/disk --time-budget-s 290 --system-timeout-s 170 > $R/peers_disk.log 2>&1
echo "disk rc=$?"; tail -6 $R/peers_disk.log
timeout 190 python3 scripts/bench_peers.py --model 1b --nproc 2 --systems host_gpu0,zero_offload \
  --micro-batches 1 --rounds 1 --steps 6 --warmup-steps 2 --device-kind $KIND --out $R --log-dir $R/logs/host \
  --time-budget-s 180 --system-timeout-s 120 > $R/peers_host.log 2>&1
echo "host rc=$?"; tail -6 $R/peers_host.log
cd $OUT && tar czf results.tgz r && rm -rf r
