# Session 28, call 4 ($1: HEAD, $2: kind). The disk regime at 4 ranks with the new defaults (model.reshard_after_forward:
# auto beside activation_checkpointing: auto): bench_peers' disk_gpu0 (1.35B, seq 2048, mb 1, clipping, 2.5 GiB a rank,
# subgroups of 26M, every byte of state through the node's disk), the disk's raw speed before and after; then two more
# 4/1-rank host-regime pairs with the defaults (bench_scale, a shared profile: the first of each rank count timed).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 200 python3 scripts/bench_peers.py --model 1b --nproc 4 --systems disk_gpu0 --micro-batches 1 --rounds 1 --steps 4 \
  --warmup-steps 2 --host-budget-gb 2.5 --train-override offload.subgroup_numel=26000384 --raw-io-gib 2 --device-kind $KIND \
  --out $R --log-dir $R/logs/peers --time-budget-s 190 --system-timeout-s 180 > $R/peers_disk.log 2>&1; echo "disk rc=$?"
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 245 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 100 \
  --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
tail -25 $R/peers_disk.log | cut -c1-250
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        print('%d ckpt=%s raf=%s it %.3f fwd %.3f bwd %.3f upd %.3f kern %.3f/%.3f gpu %.1f p/m %.2f %s loss %.4f->%.4f' % (x['nproc'], x['activation_checkpointing'], x['reshard_after_forward'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['cpu_kernel_s'], x['predicted_cpu_s'], x['gpu_peak_gib'], x['predicted_over_measured'], x['cpu_rate_source'], x['losses'][0], x['losses'][-1]))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
