# session 25, call 2 (4-GPU kind): each subgroup updated piece by piece, a piece's params back in the model as soon as
# they are new, so the next forward's unit waits for its own piece (HEAD), against f99c742 (whole subgroups; its package
# first on PYTHONPATH, its own extensions dir), in turns: host regime at 4 and 1 rank. First the GPU tests at HEAD.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" $R/pytest_gpu.log | tail -2
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
for round in 1 2; do
  timeout 110 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/new$round --timeout 50 \
    --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_new$round.log 2>&1; echo "new rc=$?"
  PYTHONPATH=$PWD/.carry/old_f99c742 TORCH_EXTENSIONS_DIR=/tmp/ext_old FSDP_OFFLOAD_COMMIT=f99c742 timeout 130 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/old$round --timeout 60 \
    --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_old$round.log 2>&1; echo "old rc=$?"
done
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        print('%-8s %-7s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f kernel %.3f p/m %.2f' % (d['commit'][:7], x['case'][:7], x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('exposed_update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
