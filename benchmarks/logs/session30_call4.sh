# Session 30, call 4 ($1: HEAD, $2: kind), on call 3's warm machine: the grad hooks' cost a param
# (bench_hook_cost, cuda), 991daa6 (its package first on PYTHONPATH) and HEAD in turns, three rounds.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz r); }
trap pack EXIT
OLD=$PWD/.carry/old991
for v in old new old new old new; do
  if [ $v = old ]; then PP=$OLD; C=991daa6; else PP=; C=$1; fi
  FSDP_OFFLOAD_COMMIT=$C PYTHONPATH=$PP timeout 60 python3 scripts/bench_hook_cost.py --device cuda --device-kind $2 --steps 100 --out $R/hook_$v > $R/hook_cost_$v.log 2>&1; echo "hook $v rc=$? $(tail -1 $R/hook_cost_$v.log | cut -c1-90)"
done
