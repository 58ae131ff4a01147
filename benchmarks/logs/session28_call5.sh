# Session 28, call 5 ($1: HEAD, $2: kind). The GPU tests at HEAD (after the step frees what an eval forward left gathered).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/cards.txt
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
cd $OUT && tar czf results.tgz r && rm -rf r
