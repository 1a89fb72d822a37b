#!/usr/bin/env python3
"""The main job (``torchrun --nproc-per-node=N scripts/pretrain_bagel.py [key=value ...]``): a shim for
``bridge.models.bagel.launch`` (also ``torchrun -m bridge.models.bagel.launch`` and the ``bagel-train`` console
script); every option and key is documented there and in docs/configuration.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.models.bagel.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
