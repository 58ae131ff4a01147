# Session 29, call 1 ($1: HEAD, $2: kind). GPU tests at HEAD (first GPU run of d75ae50's IOWorkers.run_all, the kvikio
# tier's chunked path); then where the 4-rank backward goes: the 1.35B (seq 2048, mb 1, clip, host regime, defaults)
# profiled at step 5 at 4 ranks and 1 rank, and plain FSDP2 (offload=none, units kept gathered) at 4 and 1 ranks,
# the 4-rank one profiled too; trace_waits / trace_ops over each 4-rank trace.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
timeout 210 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.profile_step=5 $P"
timeout 150 python3 scripts/bench_scale.py --device-kind $KIND --steps 7 --out $R --log-dir $R/logs/host --timeout 70 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
G="model=1b offload=none model.reshard_after_forward=false data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=8 train.progress=false"
mkdir -p $R/logs/gpu4 $R/logs/gpu1
timeout 70 python3 -m torch.distributed.run --nproc-per-node 4 scripts/train.py $G train.profile_step=5 train.out_dir=$R/logs/gpu4 hydra.run.dir=$R/logs/gpu4/hydra > $R/logs/gpu4/train.log 2>&1; echo "gpu4 rc=$?"
timeout 60 python3 scripts/train.py $G train.out_dir=$R/logs/gpu1 hydra.run.dir=$R/logs/gpu1/hydra > $R/logs/gpu1/train.log 2>&1; echo "gpu1 rc=$?"
for d in host/case0 host/case1 gpu4; do
  timeout 40 python3 scripts/trace_waits.py $R/logs/$d --step 5 --device-kind $KIND --out $R > $R/waits_${d//\//_}.log 2>&1
  timeout 40 python3 scripts/trace_ops.py $R/logs/$d --step 5 --device-kind $KIND --out $R > $R/ops_${d//\//_}.log 2>&1
done
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        print('%d it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f gpu %.1f p/m %.2f %s' % (x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['exposed_update_s'], x['gpu_peak_gib'], x['predicted_over_measured'], x['cpu_rate_source']))
for d in ('gpu4','gpu1'):
    try:
        rows=[json.loads(l) for l in open(f'{r}/logs/{d}/metrics.jsonl')][1:]
        rows=[x for x in rows if not x.get('profiled')]
        m=lambda k: statistics.fmean(x[k] for x in rows)
        print(d, 'it %.3f fwd %.3f bwd %.3f upd %.3f' % (m('step_s'), m('forward_s'), m('backward_s'), m('update_s')))
    except Exception as e: print(d, 'no metrics', e)
PY
for f in $R/waits_*.log $R/ops_host_case0.log; do echo "== $f"; tail -22 $f | cut -c1-200; done
cd $R/logs && tar czf $OUT/traces.tgz */trace_step5_rank0.json* host/case0/trace_step5_rank*.json* 2>/dev/null; ls -la $OUT/traces.tgz
find $R/logs -name 'trace_step*' -delete
cd $OUT && tar czf results.tgz r && rm -rf r
