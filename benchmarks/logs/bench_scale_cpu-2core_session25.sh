#!/bin/bash
# The session-26 driver: "before" ran from `git archive 750f60f` unpacked at $BEFORE_DIR (the planner without its fixed costs), "after" from this checkout; alternated after, before, ...
# bench.sh before|after : one bench_scale call of the three tiny cases, its JSON to benchmarks/results,
# its stdout and its case dirs under benchmarks/logs
set -e
which=$1
cd /work/main
tag=$(date +%Y%m%d-%H%M%S)
logdir=/tmp/nb/logs/$which-$tag
mkdir -p $logdir
if [ "$which" = before ]; then
  export PYTHONPATH=$BEFORE_DIR FSDP_OFFLOAD_COMMIT=$(cat $BEFORE_DIR.commit)
  script=$BEFORE_DIR/scripts/bench_scale.py
else
  script=scripts/bench_scale.py
fi
echo "load before: $(cat /proc/loadavg)" > $logdir/stdout.log
python3 $script --device-kind cpu-2core --steps 20 --out /work/main/benchmarks/results --log-dir $logdir \
  --case "nproc=1" --case "nproc=2" --case "nproc=2 offload.host_budget_gb=0.0008" >> $logdir/stdout.log 2>&1
echo "load after: $(cat /proc/loadavg)" >> $logdir/stdout.log
json=$(grep -o 'benchmarks/results/bench_scale_cpu-2core_[0-9-]*.json' $logdir/stdout.log | tail -1)
stem=$(basename $json .json)
cp $logdir/stdout.log benchmarks/logs/$stem.log
tar -czf benchmarks/logs/$stem.tgz --exclude=hydra -C /tmp/nb/logs $which-$tag
echo $which $json
