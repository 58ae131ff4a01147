# Next session, call 1 (written in session 22). $1: HEAD's commit, $2: the kind (a 2- or 4-GPU kind; N ranks below).
# GPU tests at HEAD (the copy back as one _foreach_copy_ a subgroup has run only on a CPU), then that change against
# d3c96ce (its package in .carry/old_d3c96ce, first on PYTHONPATH) in turns: host regime at 1 and N ranks, the update,
# its CPU kernel (cpu_kernel_s) and the planner beside each; then the copy-back region of a profiled step.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2; N=${3:-2}
R=$OUT/r; mkdir -p $R/logs
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/pytest_gpu.log
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
for round in 1 2; do
  PYTHONPATH=$PWD/.carry/old_d3c96ce FSDP_OFFLOAD_COMMIT=d3c96ce timeout 110 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/old$round --timeout 50 \
    --case "nproc=1 $C" --case "nproc=$N $C" > $R/scale_old$round.log 2>&1; echo "old rc=$?"
  timeout 110 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/new$round --timeout 50 \
    --case "nproc=1 $C" --case "nproc=$N $C" > $R/scale_new$round.log 2>&1; echo "new rc=$?"
done
timeout 90 python3 scripts/train.py $C train.steps=6 train.progress=false train.profile_step=4 offload.overlap=none train.out_dir=$R/logs/prof1 hydra.run.dir=$R/logs/prof1/hydra > $R/prof1.log 2>&1; echo "prof rc=$?"
python3 scripts/trace_ops.py $R/logs/prof1 --step 4 --region fsdp_offload.copy_back --device-kind $KIND --out $R --top 6 | tail -8
gzip $R/logs/prof1/trace_step4_rank*.json
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        print('%-8s %-7s it %.3f fwd %.3f bwd %.3f upd %.3f kernel %.3f pred %.3f p/m %.2f' % (d['commit'][:7], x['case'][:7], x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_update_s',0), x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
