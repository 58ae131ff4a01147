# session 25, call 3 (4-GPU kind): pieces (HEAD) against whole subgroups (f99c742) at 4 ranks, each with every core of
# the rank's share (16) and with one left for the rank's launching thread (train.cpu_threads=15), and 1 rank of each,
# in turns, two rounds: does the forward's overlap with the update pay once the update leaves it a core?
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
OLD="env PYTHONPATH=$PWD/.carry/old_f99c742 TORCH_EXTENSIONS_DIR=/tmp/ext_old FSDP_OFFLOAD_COMMIT=f99c742"
for round in 1 2; do
  timeout 100 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/new$round --timeout 45 \
    --case "nproc=4 $C" --case "nproc=4 $C train.cpu_threads=15" --case "nproc=1 $C" > $R/scale_new$round.log 2>&1; echo "new rc=$?"
  $OLD timeout 120 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/old$round --timeout 45 \
    --case "nproc=4 $C" --case "nproc=4 $C train.cpu_threads=15" --case "nproc=1 $C" > $R/scale_old$round.log 2>&1; echo "old rc=$?"
done
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        t='t15' if 'cpu_threads=15' in x['case'] else 'all'
        print('%-8s %-7s %s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f kernel %.3f p/m %.2f' % (d['commit'][:7], x['case'][:7], t, x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('exposed_update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
