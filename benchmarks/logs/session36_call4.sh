# Session 36, call 4 ($1: HEAD): the GPU tests at HEAD (after the one-add-a-unit change, its review fixes and the
# GradScaler message).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 300 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
