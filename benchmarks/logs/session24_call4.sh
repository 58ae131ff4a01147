# session 24, call 4 (4-GPU kind): why the planner's timed kernel runs slower than the step's (call 3: 3.6 against
# 5.1-5.3 G params/s at 1 rank): bench_update_gap's planner / sweep / repeat / step_memory at 1x64 and 4x16, and at
# 4x16 the old kernel (6bcf872) beside; then the kernel inside the step (bench_scale, 4 and 1 rank) on the same
# machine; then scaling 1 -> 4 ranks, three rounds, GPU-only beside.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
G="scripts/bench_update_gap.py --device-kind $KIND --out $R --rounds 8 --repeat 2 --cold-sets 4"
timeout 60 python3 $G --ranks 1 --threads 64 --numel 67108864 --variants planner,sweep,repeat,step_memory > $R/gap1.log 2>&1; echo "gap1 rc=$?"; tail -n 9 $R/gap1.log
for k in old new; do
  if [ $k = old ]; then P="PYTHONPATH=$PWD/.carry/old_6bcf872 TORCH_EXTENSIONS_DIR=/tmp/ext_old FSDP_OFFLOAD_COMMIT=6bcf872"; else P=""; fi
  env $P timeout 80 python3 $G --ranks 4 --threads 16 --numel 33554432 --variants planner,sweep,repeat > $R/gap4_$k.log 2>&1; echo "gap4 $k rc=$?"; grep -v -i warn $R/gap4_$k.log | tail -n 7
done
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
timeout 90 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 45 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        print('%-7s it %.3f upd %.3f kernel %.3f pred %.3f rate %.0f p/m %.2f' % (x['case'][:7], x.get('iteration_s',0), x.get('update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_update_s',0), x.get('cpu_mparams_per_s',0), x.get('predicted_over_measured',0)) if 'error' not in x else x['error'][:200])
PY
for n in 1 4; do
B=$((100 + 15 * n))
timeout $((B + 5)) python3 scripts/bench_peers.py --model 1b --nproc $n --systems gpu_only,host_gpu0 --micro-batches 1 --rounds 3 --steps 10 --warmup-steps 2 \
  --device-kind $KIND --out $R --log-dir $R/logs/peers$n --time-budget-s $B --system-timeout-s 45 > $R/bench_peers_n$n.log 2>&1
echo "bench_peers nproc=$n rc=$?"; grep -A5 "^system" $R/bench_peers_n$n.log | head -6
done
cd $OUT && tar czf results.tgz r && rm -rf r
