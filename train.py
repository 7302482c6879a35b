"""Entry point: ``python train.py --job.config_file configs/debug_model.toml`` or the same under ``torchrun``."""

import sys

from titanlike.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
