# session 23, call 6: the overlap GPU test with deterministic kernels (call 5: its guard saw two synchronous runs differ)
set -u
source .carry/dev_setup.sh
mkdir -p $OUT/r
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_overlap_gpu.py > $OUT/r/pytest_gpu_overlap.log 2>&1; echo "rc=$?"; tail -2 $OUT/r/pytest_gpu_overlap.log
grep -E "^E " $OUT/r/pytest_gpu_overlap.log | head -5
