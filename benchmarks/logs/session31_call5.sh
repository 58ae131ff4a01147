# Session 31, call 4 ($1: HEAD, $2: kind). The hooks' cost at 8 micro-batches (grad_accumulation=gpu): f25923f (one
# add a param) against HEAD (one add a run), in turns, each under a 75 s watchdog.
set -u
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2; export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
OLD=$PWD/.carry/oldf259
W="python3 .carry/s31_watch.py scripts/bench_hook_cost.py --device cuda --device-kind $KIND --steps 15 --micro-batches 8 --out $R"
for k in 1 2; do
  PYTHONPATH=$OLD FSDP_OFFLOAD_COMMIT=f25923f WATCH_S=75 timeout 90 $W >> $R/hook_cost.log 2>&1; echo "old rc=$?"; tail -1 $R/hook_cost.log
  PYTHONPATH=$PWD WATCH_S=75 timeout 90 $W >> $R/hook_cost.log 2>&1; echo "new rc=$?"; tail -1 $R/hook_cost.log
  pack
done
