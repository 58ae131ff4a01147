# Session 27, call 3 ($1: HEAD, $2: kind). (1) Which OpenMP runtimes a process maps once torch and the fused kernel are
# loaded: two (torch's bundled one and the system's libgomp the extension links) would give two thread pools of a
# rank's threads each. (2) Where there are two: the CPU rate and fixed costs at 64 threads (.carry/s27_probe2.py) and
# bench_scale's host regime at 4 and 1 ranks, in turns with both runtimes and with one (torch's, put first on
# LD_LIBRARY_PATH as libgomp.so.1: the loader then finds the file it already mapped). Else bench_scale 4,1,4,1 alone.
set -u
source .carry/dev_setup.sh
export FSDP_OFFLOAD_COMMIT=$1; KIND=$2
R=$OUT/r; mkdir -p $R/logs
nvidia-smi -L > $R/cards.txt
CHECK='import torch, json; from fsdp_offload.kernels import get_adamw_kernel; print(get_adamw_kernel("auto")); print(json.dumps(sorted({l.split()[-1] for l in open("/proc/self/maps") if "omp" in l.split()[-1]})))'
python3 -c "$CHECK" > $R/omp_default.txt 2>&1; cat $R/omp_default.txt
TORCH_OMP=$(python3 -c "$CHECK" 2>/dev/null | tail -1 | python3 -c "import json,sys; print(next((p for p in json.load(sys.stdin) if '/torch' in p), ''))")
N=$(tail -1 $R/omp_default.txt | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
ls -la $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib | grep -i omp >> $R/omp_default.txt
P="offload.bandwidth_profile=$R/profile.json"
C="model=1b offload=host offload.gpu_fraction=0 data.seq_len=2048 data.micro_batch=1 train.seed=0 train.lr=1e-4 train.warmup_steps=1 $P"
scale() { timeout $1 python3 scripts/bench_scale.py --device-kind $KIND --steps 8 --out $R --log-dir $R/logs/$2 --timeout 60 "${@:3}" > $R/scale_$2.log 2>&1; echo "scale $2 rc=$?"; }
if [ "$N" -ge 2 ] && [ -n "$TORCH_OMP" ]; then
  mkdir -p /tmp/omp && ln -sf $TORCH_OMP /tmp/omp/libgomp.so.1
  LD_LIBRARY_PATH=/tmp/omp:${LD_LIBRARY_PATH:-} python3 -c "$CHECK" > $R/omp_unified.txt 2>&1; echo unified: $(tail -1 $R/omp_unified.txt)
  for v in default unified default unified; do
    if [ $v = unified ]; then L=/tmp/omp:${LD_LIBRARY_PATH:-}; else L=${LD_LIBRARY_PATH:-}; fi
    LD_LIBRARY_PATH=$L timeout 40 python3 .carry/s27_probe2.py 64 1048576 > $R/probe_$v.log 2>&1; echo "$v $(grep -E '^RATE' $R/probe_$v.log)" | tee -a $R/probe_ab.txt
  done
  scale 105 default1 --case "nproc=4 $C" --case "nproc=1 $C"
  LD_LIBRARY_PATH=/tmp/omp:${LD_LIBRARY_PATH:-} scale 105 unified1 --case "nproc=4 $C" --case "nproc=1 $C"
  scale 105 default2 --case "nproc=4 $C" --case "nproc=1 $C"
  LD_LIBRARY_PATH=/tmp/omp:${LD_LIBRARY_PATH:-} scale 105 unified2 --case "nproc=4 $C" --case "nproc=1 $C"
else
  echo "one OpenMP runtime: $N"
  scale 200 host --case "nproc=4 $C" --case "nproc=1 $C" --case "nproc=4 $C" --case "nproc=1 $C"
fi
python3 - <<'PY'
import json,glob,os,re
r=os.environ['OUT']+'/r'
for f in sorted(glob.glob(r+'/bench_scale_*.json')):
    d=json.load(open(f))
    for x in d['runs']:
        if 'error' in x: print(x['error'][:200]); continue
        walk=x['update_s']-x['cpu_kernel_s']-x['norm_s']
        print('%s %d %-7s it %.3f fwd %.3f bwd %.3f upd %.3f kern %.3f walk %.3f | pred %.3f cpu %.3f walk %.3f p/m %.2f' % ((re.search(r'logs/(\w+)', json.dumps(d.get('command',''))) or re.search('','')).group(1) if re.search(r'logs/(\w+)', json.dumps(d.get('command',''))) else '?', x['nproc'], x.get('cpu_rate_source'), x['iteration_s'], x['forward_s'], x['backward_s'], x['update_s'], x['cpu_kernel_s'], walk, x['predicted_update_s'], x['predicted_cpu_s'], x.get('predicted_walk_s') or 0, x['predicted_over_measured']))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
