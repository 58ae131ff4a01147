# Session 29, call 2 ($1: HEAD, $2: kind). The GPU tests again, under faulthandler (call 1's run reported every test and
# then hung before its last line: SIGABRT at 200 s dumps every thread), with --durations; the timed-rate probe
# (threads of one process against one process a team) before and after a 4/1-rank host-regime pair (1.35B, seq 2048,
# mb 1, clip, defaults, a fresh profile: both timed first runs); plain FSDP2 (offload=none, units kept gathered) at 4
# and 1 ranks, the scaling control.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 200 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=25 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
timeout 60 python3 .carry/s29_rate_probe.py before > $R/rate_probe.log 2>&1; echo "probe rc=$?"
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
timeout 130 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/host --timeout 60 \
  --case "nproc=4 $C" --case "nproc=1 $C" > $R/scale_host.log 2>&1; echo "host rc=$?"
timeout 60 python3 .carry/s29_rate_probe.py after >> $R/rate_probe.log 2>&1; echo "probe rc=$?"
G="model=1b offload=none model.reshard_after_forward=false data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=8 train.progress=false"
mkdir -p $R/logs/gpu4 $R/logs/gpu1
timeout 50 python3 -m torch.distributed.run --nproc-per-node 4 scripts/train.py $G train.out_dir=$R/logs/gpu4 hydra.run.dir=$R/logs/gpu4/hydra > $R/logs/gpu4/train.log 2>&1; echo "gpu4 rc=$?"
timeout 40 python3 scripts/train.py $G train.out_dir=$R/logs/gpu1 hydra.run.dir=$R/logs/gpu1/hydra > $R/logs/gpu1/train.log 2>&1; echo "gpu1 rc=$?"
python3 - <<'PY'
import json,glob,os,statistics
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for i,x in enumerate(json.load(open(f))['runs']):
        if 'error' in x: print(x['error'][:300]); continue
        print('%d it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f kern %.3f/%.3f p/m %.2f %s rate %.0f' % (x['nproc'], x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['exposed_update_s'], x['cpu_kernel_s'], x['predicted_cpu_s'], x['predicted_over_measured'], x['cpu_rate_source'], x['cpu_mparams_per_s']))
for d in ('gpu4','gpu1'):
    try:
        rows=[json.loads(l) for l in open(f'{r}/logs/{d}/metrics.jsonl')][1:]
        m=lambda k: statistics.fmean(x[k] for x in rows)
        print(d, 'it %.3f fwd %.3f bwd %.3f upd %.3f' % (m('step_s'), m('forward_s'), m('backward_s'), m('update_s')))
    except Exception as e: print(d, 'no metrics', e)
pr=json.load(open(r+'/profile.json'))['update_rates']
for k,v in list(pr.values())[0].items(): print('learned', k[:40], {q: round(w) for q,w in v['mparams_per_s'].items()})
PY
grep -h "PROBE" $R/rate_probe.log | cut -c1-200
grep -n "Thread\|File" $R/pytest_gpu.log | head -60
cd $OUT && tar czf results.tgz r && rm -rf r
