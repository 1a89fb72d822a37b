"""``BagelPacker``: the official BAGEL ``PackedDataset.__iter__`` loop (spec §5), bit-exact, with state.

Randomness comes from the process-global ``random`` (group choice, CFG dropout) and ``numpy.random``
(timesteps) in exactly the official order; isolating it is ``BagelRNGIterator``'s job. Official quirks are
kept (flush drop, ``<`` vs ``>`` length checks, uncapped mandatory samples) but nothing is silent: every
dropped sample is counted by reason in ``packer.drops``.

State (taken between batches) is small: the overflow buffer as (group, restore key) pairs, the drop
counts, the batch count and per-group consumption. Buffered samples are rebuilt on load through their
group source's ``restore_sample(key)``.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..state import Savable, StateError
from ..stats import DropCounter
from .sequence import PackLayout, SequenceBuilder, sample_field

__all__ = ["BagelPacker", "SPECIAL_TOKEN_KEYS", "restore_key_of"]

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")


def restore_key_of(sample: Any) -> Any:
    """The small key a group source can rebuild ``sample`` from (``restore_key`` field), or None."""
    if isinstance(sample, dict):
        return sample.get("restore_key")
    return getattr(sample, "restore_key", None)


def _estimate(sample: Any) -> int:
    """Official length estimate: num_tokens + 2 per plan item (bos/eos or soi/eoi)."""
    return sample_field(sample, "num_tokens") + 2 * len(sample_field(sample, "sequence_plan"))


class BagelPacker(Savable):
    """Packs samples from weighted groups into official BAGEL batches (``next(packer)``)."""

    _savable_fields = ("buffer", "drops", "num_batches", "consumed")

    def __init__(
        self,
        group_iters: Sequence[Iterator[Any]],
        group_weights: Sequence[float],
        is_mandatory: Sequence[bool],
        special_tokens: Mapping[str, int],
        *,
        expected_num_tokens: int = 32768,
        max_num_tokens_per_sample: int = 16384,
        max_num_tokens: int = 36864,
        prefer_buffer_before: int = 16384,
        max_buffer_size: int = 50,
        interpolate_pos: bool = False,
        use_flex: bool = False,
        text_cond_dropout_prob: float = 0.1,
        vit_cond_dropout_prob: float = 0.4,
        vae_cond_dropout_prob: float = 0.1,
        vae_image_downsample: int = 16,
        max_latent_size: int = 32,
        vit_patch_size: int = 14,
        max_num_patch_per_side: int = 70,
        group_names: Sequence[str] | None = None,
    ) -> None:
        n = len(group_iters)
        if n == 0:
            raise ValueError("BagelPacker needs at least one group")
        if len(group_weights) != n or len(is_mandatory) != n:
            raise ValueError(
                f"BagelPacker: {n} groups but {len(group_weights)} weights and {len(is_mandatory)} mandatory flags"
            )
        total = float(sum(group_weights))
        if not total > 0:
            raise ValueError(f"BagelPacker: the group weights must sum to a positive number, got {list(group_weights)}")
        missing = [k for k in SPECIAL_TOKEN_KEYS if k not in special_tokens]
        if missing:
            raise ValueError(f"BagelPacker: special_tokens lacks {missing}")
        self.group_iters = list(group_iters)
        self.group_names = list(group_names) if group_names is not None else [f"group{i}" for i in range(n)]
        self.group_weights = [float(w) for w in group_weights]
        self.is_mandatory = [bool(m) for m in is_mandatory]
        # Official cumulative probabilities: cum_i = sum(w_0..w_i) / sum(w).
        acc, self._cum = 0.0, []
        for w in self.group_weights:
            acc += w
            self._cum.append(acc / total)
        self.expected_num_tokens = expected_num_tokens
        self.max_num_tokens_per_sample = max_num_tokens_per_sample
        self.max_num_tokens = max_num_tokens
        self.prefer_buffer_before = prefer_buffer_before
        self.max_buffer_size = max_buffer_size
        self.layout = PackLayout(
            bos_token_id=int(special_tokens["bos_token_id"]),
            eos_token_id=int(special_tokens["eos_token_id"]),
            start_of_image=int(special_tokens["start_of_image"]),
            end_of_image=int(special_tokens["end_of_image"]),
            max_num_tokens=max_num_tokens,
            use_flex=use_flex,
            interpolate_pos=interpolate_pos,
            text_cond_dropout_prob=text_cond_dropout_prob,
            vit_cond_dropout_prob=vit_cond_dropout_prob,
            vae_cond_dropout_prob=vae_cond_dropout_prob,
            vae_image_downsample=vae_image_downsample,
            max_latent_size=max_latent_size,
            vit_patch_size=vit_patch_size,
            max_num_patch_per_side=max_num_patch_per_side,
        )
        self.drop_counter = DropCounter("BagelPacker", logger)
        self.reset_state()

    # -- declared state -----------------------------------------------------------------------------
    def reset_state(self) -> None:
        self.buffer: list[tuple[int, Any]] = []  # (group index, sample), oldest first
        self.num_batches = 0
        self.consumed = [0] * len(self.group_iters)
        self.drop_counter.reset_state()

    @property
    def drops(self) -> dict[str, int]:
        """Dropped samples by reason (``overlength_mandatory``, ``overlength``, ``flush_drop`` …)."""
        return self.drop_counter.counts

    @drops.setter
    def drops(self, counts: dict[str, int]) -> None:
        self.drop_counter.counts = dict(counts)

    def _save_field(self, name: str, value: Any) -> Any:
        if name != "buffer":
            return super()._save_field(name, value)
        entries = []
        for group, sample in value:
            key = restore_key_of(sample)
            if key is None:
                raise StateError(
                    f"BagelPacker.state_dict: a buffered sample of group {self.group_names[group]!r} "
                    f"({sample_field(sample, 'data_indexes')}) has no restore_key, so the buffer cannot be saved"
                )
            entries.append([group, key])
        return super()._save_field(name, entries)

    def _load_field(self, name: str, value: Any) -> Any:
        if name != "buffer":
            return super()._load_field(name, value)
        buffer = []
        for group, key in value:
            if not 0 <= group < len(self.group_iters):
                raise StateError(f"BagelPacker.load_state_dict: buffer entry for unknown group index {group}")
            source = self.group_iters[group]
            restore = getattr(source, "restore_sample", None)
            if restore is None:
                raise StateError(
                    f"BagelPacker.load_state_dict: group {self.group_names[group]!r} has no restore_sample(key), "
                    "so its buffered samples cannot be rebuilt"
                )
            buffer.append((group, restore(key)))
        return buffer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and len(state.get("consumed", ())) != len(self.group_iters):
            raise StateError(
                f"BagelPacker.load_state_dict: state has {len(state.get('consumed', ()))} groups, "
                f"this packer {len(self.group_iters)}"
            )
        super().load_state_dict(state)

    # -- the official loop --------------------------------------------------------------------------
    def _next_from(self, group: int) -> Any:
        try:
            sample = next(self.group_iters[group])
        except StopIteration:
            logger.warning("BagelPacker: group %r is exhausted; stopping", self.group_names[group])
            raise
        self.consumed[group] += 1
        return sample

    def _choose_group(self) -> int:
        u = random.random()
        i = bisect.bisect_right(self._cum, u)  # first i with u < cum_i
        return i if i < len(self._cum) else 0

    def _finish(self, pack: SequenceBuilder, data_indexes: list[Any]) -> dict[str, Any]:
        batch = pack.to_batch()
        batch["batch_data_indexes"] = data_indexes
        self.num_batches += 1
        return batch

    @property
    def seq_length(self) -> int:
        """Packed sequence length of every batch: ``max_num_tokens``."""
        return self.max_num_tokens

    def __iter__(self) -> "BagelPacker":
        return self

    def __next__(self) -> dict[str, Any]:
        limit = self.max_num_tokens_per_sample
        pack = SequenceBuilder(self.layout)
        data_indexes: list[Any] = []
        while True:
            if pack.curr == 0:
                for group, mandatory in enumerate(self.is_mandatory):
                    if not mandatory:
                        continue
                    while True:
                        sample = self._next_from(group)
                        est = _estimate(sample)
                        if est < limit:
                            break
                        self.drop_counter.drop(
                            "overlength_mandatory",
                            f"group {self.group_names[group]!r} sample {sample_field(sample, 'data_indexes')} "
                            f"estimated {est} tokens >= max_num_tokens_per_sample {limit}",
                        )
                    pack.pack_sample(sample)
                    data_indexes.append(sample_field(sample, "data_indexes"))
            if pack.curr < self.prefer_buffer_before and self.buffer:
                group, sample = self.buffer.pop(0)
                from_buffer = True
            else:
                group = self._choose_group()
                sample = self._next_from(group)
                from_buffer = False
            est = _estimate(sample)
            if est > limit:
                self.drop_counter.drop(
                    "overlength",
                    f"group {self.group_names[group]!r} sample {sample_field(sample, 'data_indexes')} "
                    f"estimated {est} tokens > max_num_tokens_per_sample {limit}",
                )
                continue
            if pack.curr + est > self.max_num_tokens:
                if len(self.buffer) < self.max_buffer_size and not from_buffer:
                    self.buffer.append((group, sample))
                    continue
                self.drop_counter.drop(
                    "flush_drop_buffered" if from_buffer else "flush_drop",
                    f"group {self.group_names[group]!r} sample {sample_field(sample, 'data_indexes')} "
                    f"({est} tokens) did not fit a pack of {pack.curr} tokens "
                    f"{'after leaving the buffer' if from_buffer else 'and the buffer is full'} (official flush)",
                )
                return self._finish(pack, data_indexes)
            pack.pack_sample(sample)
            data_indexes.append(sample_field(sample, "data_indexes"))
            if pack.curr >= self.expected_num_tokens:
                return self._finish(pack, data_indexes)

    def stats(self) -> dict[str, Any]:
        """Counters for telemetry: batches, per-group consumption, buffer occupancy, drops by reason."""
        per_group = {name: c for name, c in zip(self.group_names, self.consumed)}
        return {
            "num_batches": self.num_batches,
            "consumed": per_group,
            "buffer_len": len(self.buffer),
            "drops": dict(self.drops),
        }
