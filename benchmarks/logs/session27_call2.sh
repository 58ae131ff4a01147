# Session 27, call 2: probe 2 (.carry/s27_probe2.py): the 1-rank fixed costs with the timed subgroup's size varied, at
# 64 threads (a 1-rank run's) and 16 (a 4-rank run's), each in a fresh process; the CPU rate timed 3 times each.
set -u
source .carry/dev_setup.sh
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/cards.txt
timeout 150 python3 .carry/s27_probe2.py 64 65536 262144 1048576 4194304 > $R/probe2_64.log 2>&1; echo rc=$?
timeout 90 python3 .carry/s27_probe2.py 16 65536 262144 1048576 > $R/probe2_16.log 2>&1; echo rc=$?
OMP_WAIT_POLICY=passive timeout 90 python3 .carry/s27_probe2.py 64 65536 1048576 > $R/probe2_64_passive.log 2>&1; echo rc=$?
for f in $R/probe2_*.log; do echo "== $(basename $f)"; grep -E "RATE|PROBE" $f | python3 -c "
import sys,json
for l in sys.stdin:
    k,v=l.split(' ',1); r=json.loads(v)
    print(k, ' '.join('%s=%s'%(a,('%.3f'%b if isinstance(b,float) else ([round(x) for x in b] if isinstance(b,list) else b))) for a,b in r.items()))"; done
cd $OUT && tar czf results.tgz r && rm -rf r
