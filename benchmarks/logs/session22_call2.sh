# session 22, call 2 (2-GPU kind): per-GPU scaling 1 -> 2 ranks at micro-batch 1 with GPU-only FSDP2 beside, three
# rounds; the hooks' cost a param on a GPU, 7ffe517 (.carry/old_7ffe517 first on PYTHONPATH) against HEAD in turns;
# each rank bound to its half of the cores against unbound, interleaved. One tarball back.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
for n in 1 2; do
timeout 170 python3 scripts/bench_peers.py --model 1b --nproc $n --systems gpu_only,host_gpu0 --micro-batches 1 --rounds 3 --steps 10 --warmup-steps 2 \
  --device-kind $KIND --out $R --log-dir $R/logs/peers$n --time-budget-s 160 --system-timeout-s 60 > $R/bench_peers_n$n.log 2>&1
echo "bench_peers nproc=$n rc=$?"
done
for round in 1 2; do
  PYTHONPATH=$PWD/.carry/old_7ffe517 FSDP_OFFLOAD_COMMIT=7ffe517 timeout 60 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --out $R 2>&1 | tail -1
  timeout 60 python3 scripts/bench_hook_cost.py --device cuda --device-kind $KIND --out $R 2>&1 | tail -1
done
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=10 train.progress=false"
i=0
for v in unbound bound unbound bound; do
  i=$((i+1)); D=$R/logs/bind$i-$v
  if [ $v = bound ]; then
    timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python bash .carry/bind_rank.sh scripts/train.py $C train.cpu_threads=16 train.out_dir=$D hydra.run.dir=$D/hydra > $D.log 2>&1
  else
    timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/train.py $C train.out_dir=$D hydra.run.dir=$D/hydra > $D.log 2>&1
  fi
  echo "bind$i $v rc=$?"
done
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for d in sorted(glob.glob(r+'/logs/bind*')):
    if not os.path.isdir(d): continue
    rows=[json.loads(l) for l in open(d+'/metrics.jsonl')][1:]
    m=lambda k: statistics.fmean(x[k] for x in rows)
    print(os.path.basename(d), 'step %.3f fwd %.3f bwd %.3f upd %.3f' % (m('step_s'), m('forward_s'), m('backward_s'), m('update_s')))
for f in sorted(glob.glob(r+'/bench_peers_*.json')):
    for k,v in json.load(open(f))['runs'].items(): print(os.path.basename(f), k, v.get('nproc'), 'it', v.get('iteration_s'), 'rounds', v.get('iteration_s_rounds'), 'bwd', v.get('backward_s'))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
