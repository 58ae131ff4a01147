# Session 31, call 4 ($1: HEAD, $2: kind; on call 3's machine, warm). Call 3 rerun with the package on PYTHONPATH. Call 2's bench_hook_cost at 8 micro-batches never finished at 97f0f76 (twice,
# 100 s each) while f25923f's did: each run under a watchdog that dumps every thread's stack at 60 s.
set -u
true
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2; export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
OLD=$PWD/.carry/oldf259
export PYTHONPATH=$PWD; W="python3 .carry/s31_watch.py scripts/bench_hook_cost.py --device cuda --device-kind $KIND --steps 3"
WATCH_S=60 timeout 90 $W --micro-batches 8 --out $R > $R/new_mb8.log 2>&1; echo "new mb8 rc=$?"; grep -v Warn $R/new_mb8.log | tail -40
pack
true
pack
WATCH_S=60 timeout 90 $W --micro-batches 2 --out $R > $R/new_mb2.log 2>&1; echo "new mb2 rc=$?"; tail -2 $R/new_mb2.log
