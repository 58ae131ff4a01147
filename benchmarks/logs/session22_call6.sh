# session 22, call 6 (2-GPU kind): where the 13-16 ms of the update outside the CPU kernel go: step 4 of the host
# regime at 1 rank profiled (train.profile_step=4; offload.overlap=none: the update then runs inside the step, on the training thread), the update's thread read by trace_ops (regions fsdp_offload.*).
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 train.steps=6 train.progress=false train.profile_step=4 offload.overlap=none"
timeout 120 python3 scripts/train.py $C train.out_dir=$R/logs/prof1 hydra.run.dir=$R/logs/prof1/hydra > $R/prof1.log 2>&1; echo "prof rc=$?"
for region in "fsdp_offload.update" "fsdp_offload.update_subgroup" "fsdp_offload.copy_back" "fsdp_offload.step_begin"; do
  python3 scripts/trace_ops.py $R/logs/prof1 --step 4 --region "$region" --device-kind $KIND --out $R --top 10 2>&1 | tail -14
done
python3 -c "import json; [print(round(r[\"update_s\"],3), round(r[\"cpu_kernel_s\"],3)) for r in map(json.loads, open(\"$R/logs/prof1/metrics.jsonl\"))]"
gzip $R/logs/prof1/trace_step4_rank*.json
cd $OUT && tar czf results.tgz r && rm -rf r
