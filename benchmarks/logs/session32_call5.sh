# Session 32, call 5 ($1: HEAD). GPU tests at the session's last code (the SIGTERM handler, checkpoint interrupts,
# the tier lock's close, after helper-55's review).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
