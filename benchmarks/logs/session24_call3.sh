# session 24, call 3 (4-GPU kind): the fused kernel's MKL sqrt kept to its own thread (HEAD) against 6bcf872 (its package
# first on PYTHONPATH, its own extensions dir), in turns: host regime at 1 and 4 ranks, the kernel inside the step
# (cpu_kernel_s) and the planner beside each. First the rate probe: the planner's timing and a step-like sweep, before
# and after a set_num_threads, with HEAD's kernel.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
# (.carry/s24_rate_probe.py is kept as benchmarks/logs/session24_call3_rate_probe.py)
OUT=$R timeout 100 python3 .carry/s24_rate_probe.py > $R/rate_probe.log 2>&1; echo "probe rc=$?"; cat $R/rate_probe.log | grep -v Warn
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
for round in 1 2; do
  PYTHONPATH=$PWD/.carry/old_6bcf872 TORCH_EXTENSIONS_DIR=/tmp/ext_old FSDP_OFFLOAD_COMMIT=6bcf872 timeout 130 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/old$round --timeout 60 \
    --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_old$round.log 2>&1; echo "old rc=$?"
  timeout 110 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/new$round --timeout 50 \
    --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_new$round.log 2>&1; echo "new rc=$?"
done
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        print('%-8s %-7s it %.3f fwd %.3f bwd %.3f upd %.3f kernel %.3f pred %.3f rate %.0f p/m %.2f' % (d['commit'][:7], x['case'][:7], x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_update_s',0), x.get('cpu_mparams_per_s',0), x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
