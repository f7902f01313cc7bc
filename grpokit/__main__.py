"""`python -m grpokit ...` is the `grpokit` command; torchrun launches it as `torchrun ... -m grpokit train
cfg.yaml`."""

from grpokit.cli import main

if __name__ == "__main__":
    main()
