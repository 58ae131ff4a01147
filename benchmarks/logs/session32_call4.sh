# Session 32, call 4 ($1: HEAD). GPU tests at HEAD (after helper-52's and helper-53's fixes: each node plans its own
# ranks' shards, a plan short on one rank said by all, the tier measurement's failure, the run dir's pid); then
# train.py under torchrun on the 4 GPUs: the tiny model through the disk, and the 1.35B with the recipe's defaults.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz --exclude='*.lock' r); }; trap pack EXIT
nvidia-smi -L > $R/cards.txt
PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=10 > $R/pytest_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -2 $R/pytest_gpu.log
pack
mkdir -p /tmp/tiers
timeout 120 torchrun --standalone --nproc-per-node=4 scripts/train.py model=tiny offload=disk 'offload.tiers=[posix:/tmp/tiers]' \
  offload.host_budget_gb=0.0003 offload.subgroup_numel=4096 offload.gpu_fraction=0 train.steps=4 train.micro_batches=2 \
  train.progress=false hydra.run.dir=$R/tiny4 > $R/tiny4.log 2>&1; echo "tiny4 rc=$?"; grep -E "plan:|error|kept in host" $R/tiny4.log | head -5
timeout 150 torchrun --standalone --nproc-per-node=4 scripts/train.py model=1b offload=host data.seq_len=2048 train.steps=4 \
  train.progress=false hydra.run.dir=$R/host1b > $R/host1b.log 2>&1; echo "1b rc=$?"; grep -E "plan:|error" $R/host1b.log | head -4
python3 -c "
import json
for f in ('tiny4','host1b'):
    try: rows=[json.loads(l) for l in open('$R/'+f+'/metrics.jsonl')]
    except OSError as e: print(f, e); continue
    print(f, [(r.get('step'), round(r.get('loss',0),3), round(r.get('step_s',0),3)) for r in rows if 'loss' in r])
"
