# Session 37 experiment only (applied to a copy of the tree on the device machine, never committed): with EXP_ONCE set,
# FSDP2 sums a step's micro-batches in its FP32 unsharded accumulation (reduce_dtype float32, gradient sync on the
# last micro-batch only) and the optimizer takes one reduced grad a step (offload.micro_batches=1 on the command line).
import re, sys
root = sys.argv[1]
def patch(path, old, new):
    p = f"{root}/fsdp_offload/{path}"; s = open(p).read()
    assert s.count(old) == 1, (path, old); open(p, "w").write(s.replace(old, new))
patch("parallelize.py", "    model = meta_fsdp_model(args, device)\n",
      "    import os\n    model = meta_fsdp_model(args, device, MixedPrecisionPolicy(reduce_dtype=torch.float32) if os.environ.get('EXP_ONCE') else None)\n")
patch("fsdp.py", "    for modules in units:\n        _param_groups(modules[0])\n\n",
      "    import os\n    if os.environ.get('EXP_ONCE'):\n        return []\n    for modules in units:\n        _param_groups(modules[0])\n\n")
patch("train_step.py", "        (optimizer.scale_loss(loss)",
      "        import os\n        if os.environ.get('EXP_ONCE'):\n            model.set_requires_gradient_sync(micro == tcfg.micro_batches - 1)\n        (optimizer.scale_loss(loss)")
print("patched", root)
p = f"{root}/fsdp_offload/recipe.py"; s = open(p).read()
old = '    if recipe.optimizer == "offload" and recipe.config.micro_batches != tcfg.micro_batches:\n'
assert s.count(old) == 1; open(p, "w").write(s.replace(old, '    if recipe.optimizer == "offload" and recipe.config.micro_batches != tcfg.micro_batches and not __import__("os").environ.get("EXP_ONCE"):\n'))
