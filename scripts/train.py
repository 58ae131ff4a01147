"""Train with the recipes: `python scripts/train.py [Hydra overrides]`, or under torchrun. The same as
the `fsdp-offload-train` command; the loop is fsdp_offload/train.py (`run(cfg)` from Python)."""

from fsdp_offload.train import main

if __name__ == "__main__":
    main()
