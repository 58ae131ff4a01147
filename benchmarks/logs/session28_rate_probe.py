"""Session 28 probe: the planner's timed CPU rate (update_rate.node_update_rate) beside the rate a run's steps had
(the profile's learned rate, same machine, same ranks and threads), with the timing's window and cold bytes varied:
why the timed rate reads 1.2-1.6x slow. Prints one JSON line a timing and the profile's learned rates."""
import json, sys, time
import fsdp_offload.update_rate as ur
from fsdp_offload.threads import cpu_threads_per_rank

profile = sys.argv[1]
base_window, base_cold = ur.WINDOW_S, ur.COLD_BYTES
for ranks in (4, 1):
    threads = cpu_threads_per_rank(None, ranks)
    for variant, window, cold in (("base", base_window, base_cold), ("window2s", 2.0, base_cold), ("cold2GiB", base_window, 2 << 30),
                                  ("base", base_window, base_cold)):
        ur.WINDOW_S, ur.COLD_BYTES = window, cold
        t0 = time.perf_counter()
        rate = ur.node_update_rate("auto", 100 << 20, threads, ranks)
        print("PROBE", json.dumps(dict(ranks=ranks, threads=threads, variant=variant, mparams_per_s=rate / 1e6,
                                       wall_s=time.perf_counter() - t0)), flush=True)
try:
    print("PROFILE", json.dumps(json.load(open(profile))["update_rates"], default=str)[:3000])
except Exception as exc:  # noqa: BLE001
    print("PROFILE unreadable", exc)
