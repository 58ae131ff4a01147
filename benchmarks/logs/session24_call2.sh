# session 24, call 2 (4-GPU kind): does the subgroup size set the forward's tail at 4 ranks? With 100Mi subgroups a
# rank of the 1.35B holds 4 at 4 ranks (13 at 1 rank), and the forward's last layers wait for the last subgroup.
# Interleaved: 100Mi, 40Mi, 20Mi at 4 ranks, twice; 100Mi and 20Mi at 1 rank.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1"
S100=104857600; S40=41943040; S20=20971520
timeout 420 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/scale --timeout 60 \
  --case "nproc=4 $C offload.subgroup_numel=$S100" --case "nproc=4 $C offload.subgroup_numel=$S40" --case "nproc=4 $C offload.subgroup_numel=$S20" \
  --case "nproc=1 $C offload.subgroup_numel=$S100" --case "nproc=1 $C offload.subgroup_numel=$S20" \
  --case "nproc=4 $C offload.subgroup_numel=$S100" --case "nproc=4 $C offload.subgroup_numel=$S40" --case "nproc=4 $C offload.subgroup_numel=$S20" \
  > $R/scale.log 2>&1; echo "scale rc=$?"
python3 - <<'PY'
import json,glob,os
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    for x in json.load(open(f))['runs']:
        c=x['case']; tag=c.split()[0]+' '+c.split('subgroup_numel=')[1]
        print('%-18s it %.3f fwd %.3f bwd %.3f upd %.3f exp %.3f kernel %.3f p/m %.2f' % (tag, x.get('iteration_s',0), x.get('forward_s',0), x.get('backward_s',0), x.get('update_s',0), x.get('exposed_update_s',0), x.get('cpu_kernel_s') or 0, x.get('predicted_over_measured',0)) if 'error' not in x else tag+' '+x['error'][:200])
PY
cd $OUT && tar czf results.tgz r && rm -rf r
