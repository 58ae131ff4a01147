# session 25, call 4 (4-GPU kind): pieces (HEAD) with fewer CPU threads a rank (12 and 8 of the 16 cores at 4 ranks, 48 of 64
# at 1), which leaves cores to the launching thread and NCCL's while the forward runs beside the update, against whole
# subgroups (f99c742) with all cores and with 12, in turns, two rounds.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
OLD="env PYTHONPATH=$PWD/.carry/old_f99c742 TORCH_EXTENSIONS_DIR=/tmp/ext_old FSDP_OFFLOAD_COMMIT=f99c742"
for round in 1 2; do
  timeout 100 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/new$round --timeout 45 \
    --case "nproc=4 $C train.cpu_threads=12" --case "nproc=4 $C train.cpu_threads=8" --case "nproc=1 $C train.cpu_threads=48" > $R/scale_new$round.log 2>&1; echo "new rc=$?"
  $OLD timeout 100 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/old$round --timeout 45 \
    --case "nproc=4 $C" --case "nproc=4 $C train.cpu_threads=12" --case "nproc=1 $C" > $R/scale_old$round.log 2>&1; echo "old rc=$?"
done
python3 - <<'PY'
import json,glob,os,re
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        m=re.search(r'cpu_threads=(\d+)', x['case']); t='t'+m.group(1) if m else 'all'
        print('%-8s %-7s %-4s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f kernel %.3f p/m %.2f' % (d['commit'][:7], x['case'][:7], t, x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('exposed_update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
