# Session 33, call 5 ($1: HEAD). GPU tests at HEAD: the refusal of an optimizer built after the model's first forward
# (fsdp.root_fsdp_module, run on every GPU test's model), the stated host memory, the fit check's move.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
{ nvidia-smi -L; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
