"""The cooked BAGEL sample: the official per-sample dict as an Energon ``Sample``.

Cookers never raise on bad data: they return a *tombstone* (``drop_reason`` set) so that drops are
counted by the reader in the main process, also when cooking runs in worker processes.
``restore_key`` (builtins only) lets the packer persist buffered samples as keys and rebuild them
bit-exactly: it pairs the reader's key of the read (its order's coordinate) with the random choices the cooker made.
"""

from __future__ import annotations

from typing import Any

from megatron.energon import Sample
from megatron.energon.edataclass import edataclass

__all__ = ["BagelSample", "PLAN_KEYS"]

#: Keys of every ``sequence_plan`` item the source datasets produce (exactly these, official order).
PLAN_KEYS: tuple[str, ...] = ("type", "enable_cfg", "loss", "special_token_loss", "special_token_label")


@edataclass
class BagelSample(Sample):
    """One source sample of a BAGEL group (t2i_pretrain / unified_edit / vlm_sft).

    ``sequence_plan``, ``text_ids_list``, ``image_tensor_list`` (float32 (3, H, W)), ``num_tokens`` and
    ``data_indexes`` are exactly the official sample dict's entries; ``source`` is the converted
    sample's coordinate in the raw data and ``rng_choices`` the random choices made while cooking
    (indices for ``choice``, floats for ``random()``), used to replay the sample without drawing.
    ``unused`` counts parts of the raw record the official reader ignores too ({reason: count}, or None).
    """

    sequence_plan: list
    text_ids_list: list
    image_tensor_list: list
    num_tokens: int
    data_indexes: dict
    source: dict
    rng_choices: tuple
    drop_reason: str | None = None
    drop_detail: str = ""
    unused: dict | None = None

    @property
    def restore_key(self) -> tuple:
        """``(the read's key, rng choices)``: builtins only; the group reader's ``restore_sample`` input."""
        return (self.__restore_key__, self.rng_choices)

    def to_official(self) -> dict[str, Any]:
        """The official sample dict (what ``PackedDataset`` consumes from a source dataset)."""
        return {k: getattr(self, k) for k in ("sequence_plan", "text_ids_list", "image_tensor_list", "num_tokens",
                                              "data_indexes")}
