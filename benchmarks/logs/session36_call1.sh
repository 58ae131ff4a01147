# Session 36, call 1 ($1: HEAD, $2: kind, $3: ranks): GPU tests at HEAD; then one profiled step (step 3) of the 1.35B at $3 ranks (and the product at 1),
# 8 micro-batches, this product in the host regime and plain FSDP2 (offload=none): where the product's backward spends
# the ~0.2 s a step it takes over plain FSDP2's (session 35's call 4, never run).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2; NP=$3
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; grep -i memtotal /proc/meminfo; uptime; } > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 240 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/pytest_gpu.log
pack
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=4 train.profile_step=3 train.progress=false"
for c in "host $NP offload=host offload.gpu_fraction=0" "none $NP offload=none" "host1 1 offload=host offload.gpu_fraction=0"; do
  set -- $c; n=$1; np=$2; shift 2
  timeout 150 torchrun --nproc-per-node $np scripts/train.py $B "$@" train.out_dir=$R/$n hydra.run.dir=$R/$n/hydra > $R/$n.log 2>&1; echo "$n rc=$?"
  grep -h '"step": 2' $R/$n/metrics.jsonl | cut -c1-300
  pack
done
for n in host none host1; do
  timeout 60 python3 scripts/trace_waits.py $R/$n --step 3 --device-kind $KIND --out $R > $R/waits_$n.log 2>&1; tail -12 $R/waits_$n.log
  timeout 60 python3 scripts/trace_ops.py $R/$n --step 3 --device-kind $KIND --out $R --top 15 > $R/ops_$n.log 2>&1; head -20 $R/ops_$n.log
done
timeout 200 python3 .carry/s36_gaps.py $R/gaps.json $R/host $R/none $R/host1 > $R/gaps.log 2>&1; echo "gaps rc=$?"
for n in host none; do gzip -c $R/$n/trace_step3_rank0.json > $R/${n}_trace_rank0.json.gz; done
find $R -name 'trace_step*.json' -delete; ls -la $R/*.gz
python3 - <<'PY'
import json,os
g=json.load(open(os.environ['OUT']+'/r/gaps.json'))
for k,v in g.items():
    if 'rank0' in k or 'rank1' in k:
        print(k, {a:v.get(a) for a in ('backwards','backward_ms','compute_idle_gaps_over_30us_ms','gap_count','stream_busy_ms_in_backward')})
        print('  ctx', list(v.get('gap_ms_by_autograd_ctx',{}).items())[:5])
PY
