"""Prints the rows of session 27's bench_scale JSONs (one table per JSON): the reader of
bench_scale_session27_summary.txt. The walk is the update beyond its kernel and norm (update_s - cpu_kernel_s - norm_s)."""
import json
import sys

print("Session 27 device calls 1 and 3-6: rows of the bench_scale JSONs (written by scripts/bench_scale.py), printed by "
      "benchmarks/logs/bench_scale_session27_summary.py.\n")
for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"{path}: {d.get('gpu_name')} x{d.get('gpus', '?')}, commit {d.get('commit')}")
    print("ranks  compile  cpu rate  iteration_s  forward_s  backward_s  update_s  kernel_s  walk_s  predicted_s  pred_walk_s  pred/meas")
    for x in d["runs"]:
        if "error" in x:
            print("  error:", x["error"][:160])
            continue
        walk = x["update_s"] - x["cpu_kernel_s"] - x["norm_s"]
        print(f"{x['nproc']:5d}  {str('train.compile=true' in x['case']):>7}  {x.get('cpu_rate_source'):>8}  {x['iteration_s']:11.3f}  "
              f"{x['forward_s']:9.3f}  {x['backward_s']:10.3f}  {x['update_s']:8.3f}  {x['cpu_kernel_s']:8.3f}  {walk:6.3f}  "
              f"{x['predicted_update_s']:11.3f}  {x.get('predicted_walk_s') or 0:11.3f}  {x['predicted_over_measured']:9.2f}")
    print()
