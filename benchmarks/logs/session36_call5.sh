# Session 36, call 5 ($1: HEAD, $2: the commit before the change): at 4 ranks, the 1.35B, seq 2048, micro-batch 1,
# 8 micro-batches, clipping, host regime (gpu_fraction=0), train.py alone (7 steps): HEAD (one add a unit for later
# micro-batches) against a copy of the tree with d1c1e80's staging.py, grad_sums.py, held_grad.py, in turns.
set -u
source .carry/dev_setup.sh
NEW=$1; OLD=$2
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' --exclude='lock' r); }; trap pack EXIT
{ nvidia-smi -L; nproc; uptime; } > $R/cards.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r fsdp_offload scripts pyproject.toml /tmp/old/ && cp .carry/s36_old/*.py /tmp/old/fsdp_offload/
(cd /tmp/old && PYTHONPATH=/tmp/old python3 -c "import fsdp_offload.staging as s; print('old:', s.__file__, hasattr(s, '_storage_start'))")
python3 -c "import fsdp_offload.staging as s; print('new:', s.__file__, hasattr(s, '_storage_start'))"
B="model=1b data.seq_len=2048 data.micro_batch=1 train.micro_batches=8 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=7 train.progress=false offload=host offload.gpu_fraction=0 offload.bandwidth_profile=$R/profile.json"
new() { FSDP_OFFLOAD_COMMIT=$NEW timeout 70 torchrun --nproc-per-node 4 scripts/train.py $B train.out_dir=$R/new$1 hydra.run.dir=$R/new$1/hydra > $R/new$1.log 2>&1; echo "new$1 rc=$?"; pack; }
old() { (cd /tmp/old && FSDP_OFFLOAD_COMMIT=$OLD PYTHONPATH=/tmp/old timeout 70 torchrun --nproc-per-node 4 scripts/train.py $B train.out_dir=$R/old$1 hydra.run.dir=$R/old$1/hydra > $R/old$1.log 2>&1); echo "old$1 rc=$?"; pack; }
new a; old a; new b; old b
python3 - <<'PY'
import json, os, statistics
r = os.environ['OUT'] + '/r'
for run in ('newa', 'olda', 'newb', 'oldb'):
    p = f'{r}/{run}/metrics.jsonl'
    if not os.path.exists(p): print(run, 'no metrics'); continue
    rows = [json.loads(l) for l in open(p)][1:]
    print(run, 'step median %.3f backward median %.3f forward median %.3f' % tuple(statistics.median(x[k] for x in rows) for k in ('step_s', 'backward_s', 'forward_s')),
          ' '.join('%.3f/%.3f' % (x['step_s'], x['backward_s']) for x in rows))
PY
