"""Session 27 probe 2: the update's fixed costs (update_costs.time_update_costs) at one rank with the timed
subgroup's size varied (update_costs.MAX_NUMEL), against the 1-rank run's own walk (~1 ms a subgroup at 64 threads,
session 27 call 1); and the CPU rate (update_rate.node_update_rate) timed three times in one process.
    python s27_probe2.py THREADS NUMEL [NUMEL ...]"""
import json, sys
import fsdp_offload.update_costs as uc
from fsdp_offload.update_rate import node_update_rate

threads = int(sys.argv[1])
rates = [node_update_rate("auto", 100 << 20, threads, 1) for _ in range(3)]
print("RATE", json.dumps(dict(threads=threads, rates_mps=[r / 1e6 for r in rates])), flush=True)
for numel in map(int, sys.argv[2:]):
    uc.MAX_NUMEL = numel
    for rep in range(2):
        c = uc.time_update_costs("auto", 100 << 20, threads, 1, None, "exclusive", rates[-1])
        print("PROBE", json.dumps(dict(threads=threads, numel=numel, subgroup_ms=c.subgroup_s * 1e3, call_ms=c.call_s * 1e3,
                                       transfer_ms=c.transfer_s * 1e3, step_ms=c.step_s * 1e3)), flush=True)
