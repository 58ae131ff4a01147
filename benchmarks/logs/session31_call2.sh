# Session 31, call 2 ($1: HEAD, $2: kind). GPU tests at HEAD with each GPU child's watchdog (call 1's suite hung in
# test_state_dict_gpu's second test at f25923f); that file four times more to catch the hang's stacks; the hooks'
# cost at 8 micro-batches (grad_accumulation=gpu), f25923f (a param's add at a time) against HEAD (one add a run),
# in turns.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 280 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=15 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
pack
for k in 1 2 3 4; do
  PYTHONFAULTHANDLER=1 timeout -s ABRT 170 python3 -m pytest tests/test_state_dict_gpu.py -q -p no:cacheprovider > $R/state_dict_gpu_$k.log 2>&1; echo "state_dict_gpu $k rc=$?"; tail -1 $R/state_dict_gpu_$k.log
  pack
done
OLD=$PWD/.carry/oldf259
for k in 1 2; do
  PYTHONPATH=$OLD FSDP_OFFLOAD_COMMIT=f25923f timeout 100 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --micro-batches 8 --steps 25 --out $R >> $R/hook_cost.log 2>&1; echo "old rc=$?"; tail -1 $R/hook_cost.log
  timeout 100 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --micro-batches 8 --steps 25 --out $R >> $R/hook_cost.log 2>&1; echo "new rc=$?"; tail -1 $R/hook_cost.log
  pack
done
PYTHONPATH=$OLD python3 -c "import fsdp_offload; print(fsdp_offload.__file__)"
