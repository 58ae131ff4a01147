# Session 35, call 2 (session 34 call 2, run again) ($1: HEAD, $2: kind), on call 1's machine while warm: ZeRO-Infinity alone on the 7B at 4 ranks,
# the same model, seq, micro-batch, clipping and disk as call 1's disk_gpu0 (the two do not fit one call's 10 minutes).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; uptime; } > $R/cards.txt
timeout 580 python3 scripts/bench_peers.py --model 7b --nproc 4 --systems zero_infinity \
  --micro-batches 1 --rounds 1 --steps 2 --warmup-steps 1 --host-budget-gb 8 \
  --raw-io-gib 2 --raw-io-samples 1 --device-kind $KIND --out $R --log-dir $R/logs --time-budget-s 570 --system-timeout-s 540 > $R/peers_7b.log 2>&1
echo "7b rc=$?"; tail -8 $R/peers_7b.log
