"""Session 30 probe: the CPU cost (launching thread) of each op a grad hook runs, per call, on this GPU.
A unit of 9 bf16 grads (views of one flat reduce output, 1.35B-like sizes at 4 ranks), 200 rounds."""
import statistics, time, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from fsdp_offload.held_grad import held_like
from fsdp_offload.cache import host_buffer

dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
sizes = [2048 * 512, 2048 * 512, 2048 * 128, 2048 * 128, 2048 * 1408, 2048 * 1408, 1408 * 512, 2048 // 4, 2048 // 4]
flat = torch.randn(sum(sizes), device=dev).to(torch.bfloat16)
grads = list(torch.split(flat, sizes))
host = host_buffer(2 * sum(sizes), True).view(torch.bfloat16)
dsts = list(torch.split(host, sizes))
norms = torch.zeros(len(sizes), device=dev); slots = norms.unbind()
stream = torch.cuda.current_stream()
dts = [DTensor.from_local(g, mesh, [Shard(0)], run_check=False) for g in grads]

def per_unit(fn, rounds=300):
    ts = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6

cases = {
    "vector_norm x9": lambda: [torch.linalg.vector_norm(g, dtype=torch.float32, out=s) for g, s in zip(grads, slots)],
    "foreach_norm+copy (9)": lambda: torch._foreach_copy_(list(slots), torch._foreach_norm(grads, 2, dtype=torch.float32)),
    "copy_ D2H x9": lambda: [d.copy_(g, non_blocking=True) for d, g in zip(dsts, grads)],
    "foreach_copy_ D2H (9)": lambda: torch._foreach_copy_(dsts, grads, non_blocking=True),
    "copy_ D2H merged x1": lambda: host.copy_(flat, non_blocking=True),
    "record_stream x9": lambda: [g.record_stream(stream) for g in grads],
    "reshape x9": lambda: [g.reshape(-1) for g in grads],
    "held_like x9": lambda: [held_like(d, 1, print, print) for d in dts],
    "to_local x9": lambda: [d.to_local() for d in dts],
}
for name, fn in cases.items():
    per_unit(fn, 20)
rows = [(name, per_unit(fn)) for name, fn in cases.items()]
for name, us in rows:
    print(f"{name:28s} {us:8.1f} us a unit of 9, {us/9:6.1f} us a grad")
