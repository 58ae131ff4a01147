# session 24, call 1 (4-GPU kind): GPU tests at HEAD (the commits after 4eba912 were not GPU-run), then scaling
# 1 -> 4 ranks at micro-batch 1 with GPU-only beside (three rounds), and the planner at 4 ranks with cpu_kernel_s.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt; nproc >> $R/cards.txt
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -n 1 $R/pytest_gpu.log
grep -E "^FAILED" $R/pytest_gpu.log | head -5
for n in 1 4; do
timeout 150 python3 scripts/bench_peers.py --model 1b --nproc $n --systems gpu_only,host_gpu0 --micro-batches 1 --rounds 3 --steps 10 --warmup-steps 2 \
  --device-kind $KIND --out $R --log-dir $R/logs/peers$n --time-budget-s 140 --system-timeout-s 60 > $R/bench_peers_n$n.log 2>&1
echo "bench_peers nproc=$n rc=$?"
done
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 80 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 60 \
  --case "nproc=4 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_peers_*.json')):
    for k,v in json.load(open(f))['runs'].items(): print(os.path.basename(f), k, v.get('nproc'), 'it', v.get('iteration_s'), 'rounds', v.get('iteration_s_rounds'), 'fwd', v.get('forward_s'), 'bwd', v.get('backward_s'))
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-8s it %.3f upd %.3f kernel %.3f pred_cpu %.3f cpu/kernel %.2f p/m %.2f' % (x['case'][:7], x.get('iteration_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_cpu_s',0), x.get('predicted_cpu_over_kernel') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
