"""Bit parity with official BAGEL as a promise about versions: the one place that knows where it was proven.

The golden suites compare our tensors with ``torch.equal`` against tensors the unmodified official BAGEL code
produced (``tests/fixtures``; docs/parity.md). Those bits depend on library versions as well as on our code:
Pillow's resampling (the bicubic / Lanczos resize of every image, its decoders' handling of odd files) and
torch's float kernels (``ToTensor`` / ``Normalize`` arithmetic, the image tensors' dtype conversions). They
were proven on ``PROVEN_VERSIONS`` (the set ``uv.lock`` pins); in any other environment the tests marked
``parity`` are skipped with the reason this module gives, and ``build_bagel_train_loader`` logs one warning per
process (``warn_once_if_unproven``).

What does not depend on these versions, and must hold everywhere the package installs: every batch
satisfies the packed-batch contract, resume is bit-exact against the same environment's uninterrupted run,
the elastic order's exactly-once ledger, the budgets, the watchdog. The packer's own decisions use only
Python's ``random`` and NumPy's legacy ``RandomState`` (whose streams NumPy keeps stable across releases), so
its golden suite (``tests/test_packer_golden.py``) is not version-bound and runs everywhere.
"""

from __future__ import annotations

import logging
from importlib import metadata

__all__ = ["PROVEN_VERSIONS", "unproven_versions", "parity_note", "warn_once_if_unproven"]

logger = logging.getLogger(__name__)

#: distribution name -> the release bit parity with official BAGEL was proven on (the golden fixtures pass
#: there, in CI, from ``uv.lock``). A local build label (``2.13.0+cu130``) does not matter; anything else does.
PROVEN_VERSIONS: dict[str, str] = {"pillow": "13.0.0", "torch": "2.13.0"}

_DISPLAY = {"pillow": "Pillow"}
_warned = False


def unproven_versions() -> list[tuple[str, str | None, str]]:
    """``(distribution, installed version or None, proven version)`` for every library in ``PROVEN_VERSIONS``
    whose installed release (``"2.13.0+cu130"`` -> ``"2.13.0"``) differs; empty in the proven environment."""
    out = []
    for dist, proven in PROVEN_VERSIONS.items():
        try:
            have: str | None = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or have.split("+", 1)[0] != proven:
            out.append((dist, have, proven))
    return out


def parity_note() -> str:
    """One line: where bit parity is proven and what this environment has (``""`` when it is the proven one)."""
    mismatches = unproven_versions()
    if not mismatches:
        return ""
    proven = " and ".join(f"{_DISPLAY.get(name, name)} {v}" for name, v in PROVEN_VERSIONS.items())
    have = ", ".join(f"{_DISPLAY.get(name, name)} {v or 'not installed'}" for name, v, _ in mismatches)
    return (f"bit parity with official BAGEL is proven for {proven} only; this environment has {have}: "
            "batches, resume and the ledger are unaffected, image tensors may differ from official BAGEL's "
            "in their low bits (docs/parity.md)")


def warn_once_if_unproven() -> bool:
    """Log ``parity_note()`` as one WARNING, the first time in this process that the environment differs
    from ``PROVEN_VERSIONS``; True if it logged now."""
    global _warned
    if _warned:
        return False
    note = parity_note()
    _warned = True
    if note:
        logger.warning(note)
    return bool(note)
