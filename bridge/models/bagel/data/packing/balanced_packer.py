"""``BalancedPacker``: ``packer.strategy: balanced``, a ``BagelPacker`` whose packs all cost about the same.

It is ``BagelPacker`` (same sources, layout, batch, drops, ledger, buffer as restore keys) with the official
loop replaced by :class:`.balance.BalancedLoop`: the buffer becomes the look-ahead pool. A sample's CFG
dropout coins are drawn (global ``random``, as officially, but when it enters the pool) and replayed when it is
packed, so its packed length and its cost (:meth:`.cost.CostModel.cost` of :func:`.cost.sample_work`) are
exact when the loop chooses. The design and its guarantees are in :mod:`.balance`; the official strategy
(``BagelPacker``) is untouched.

State: ``BagelPacker``'s fields plus ``balance`` (:meth:`.balance.PoolBook.state`: the pack at which each
pooled sample entered and its dropout coins as a bit mask, this rank's pack count, and the sums of cost and
tokens of every sample drawn, from which the target follows; elastic resize: :meth:`BalancedPacker.resize_state`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..config.schema import PackerConfig
from ..state import ResizeContext, StateError
from .balance import BalancedLoop, PoolBook
from .cost import CostModel, Work, sample_work
from .packer import BagelPacker, _PackFill
from .sequence import SequenceBuilder, sample_field
from .step import PackBudgets

__all__ = ["BalancedPacker"]

_BOOK_KEYS = ("since", "notes", "packs", "seen_cost", "seen_tokens")


def _check_book(state: Any, where: str) -> None:
    """Raise ``StateError`` unless ``state`` is a ``PoolBook.state()``."""
    ok = (isinstance(state, dict) and set(state) == set(_BOOK_KEYS) and isinstance(state["since"], list)
          and isinstance(state["notes"], list) and len(state["notes"]) == len(state["since"])
          and all(isinstance(v, int) for v in (*state["since"], *state["notes"], state["packs"], state["seen_tokens"]))
          and isinstance(state["seen_cost"], (int, float)))
    if not ok:
        raise StateError(f"{where}: the balance state {state!r:.100} is not a balanced packer's (keys "
                         f"{list(_BOOK_KEYS)}: saved by another version or another strategy)")


class _PresetDropout(SequenceBuilder):
    """``SequenceBuilder`` whose CFG dropout replays ``dropped``, the coins drawn when the sample entered the pool
    (the note of :meth:`_CostedFill.enter`, ``cost.sample_work``'s bit order), instead of drawing them
    from the global ``random`` now."""

    dropped = 0

    def pack_sample(self, sample: Any) -> None:
        self._k = 0
        super().pack_sample(sample)

    def _cfg_dropped(self, item: dict, prob: float) -> bool:  # type: ignore[override]
        if item["enable_cfg"] != 1:
            return False
        self._k += 1
        return bool(self.dropped >> (self._k - 1) & 1)


class _CostedFill(_PackFill):
    """``BagelPacker``'s pack target as ``BalancedLoop`` sees it (``balance.BalanceTarget``)."""

    __slots__ = ()
    packer: "BalancedPacker"
    pack: _PresetDropout

    def enter(self, sample: Any) -> int:
        """The sample's CFG dropout, drawn now from the global ``random`` (one coin per ``enable_cfg`` item in plan
        order, against the item type's ``*_cond_dropout_prob``, as ``SequenceBuilder`` draws it): a bit mask,
        bit ``k`` set = the ``k``-th such item is dropped."""
        c = self.packer.config
        prob = {"text": c.text_cond_dropout_prob, "vit_image": c.vit_cond_dropout_prob,
                "vae_image": c.vae_cond_dropout_prob}
        items = [item for item in sample_field(sample, "sequence_plan") if item["enable_cfg"] == 1]
        return sum(1 << k for k, item in enumerate(items) if random.random() < prob[item["type"]])

    def measure(self, sample: Any, note: int) -> tuple[int, float]:
        work = self.packer.sample_work(sample, note)
        return int(work.tokens), self.packer.cost_model.cost(work)

    def add(self, group: int, sample: Any, length: int, note: int) -> None:  # type: ignore[override]
        self.pack.dropped = int(note)
        super().add(group, sample, length)


class BalancedPacker(BagelPacker):
    """``BagelPacker`` with the balanced loop (module docstring); ``config.strategy`` must be ``balanced``.

    Same arguments as ``BagelPacker``; the config is trusted (``config.validate.validate_data`` checks the
    strategy's knobs and budgets). Raises ValueError for a config of another strategy (a wiring error).
    """

    _savable_fields = (*BagelPacker._savable_fields, "balance")
    _fill_type = _CostedFill
    _builder_type = _PresetDropout

    def __init__(self, sources: Sequence[Iterator[Any]], group_weights: Sequence[float],
                 is_mandatory: Sequence[bool], special_tokens: Mapping[str, int], config: PackerConfig | None = None,
                 *, group_names: Sequence[str] | None = None) -> None:
        config = config if config is not None else PackerConfig(strategy="balanced")
        if config.strategy != "balanced":
            raise ValueError(f"BalancedPacker needs packer.strategy 'balanced', got {config.strategy!r} "
                             "(the official strategy is BagelPacker)")
        super().__init__(sources, group_weights, is_mandatory, special_tokens, config, group_names=group_names)
        self.cost_model = CostModel.of(self.config.cost)
        self._balanced: BalancedLoop[Any] = BalancedLoop(
            PackBudgets.of(self.config), self.group_weights, self.is_mandatory,
            target_tokens=self.config.balanced_target_tokens, max_wait=self.config.balance.max_wait,
            lookahead=self.config.balance.lookahead)

    def reset_state(self) -> None:
        super().reset_state()
        self._book = PoolBook(metrics=[])
        #: (tokens, FLOPs) of the last pack as the loop planned it (not state: (0, 0.0) after a restore)
        self.last_pack: tuple[int, float] = (0, 0.0)

    def sample_work(self, sample: Any, dropped: int = 0) -> Work:
        """``cost.sample_work`` of ``sample`` with the items ``dropped`` names dropped, at this packer's patch sizes."""
        c = self.config
        return sample_work(sample, vit_patch_size=c.vit_patch_size, vae_image_downsample=c.vae_image_downsample,
                           dropped=dropped)

    @property
    def balance(self) -> dict[str, Any]:
        """The balanced loop's record (``PoolBook.state``): entry pack and note per pooled sample, packs, cost
        sums (the declared state field ``balance``, saved by ``BagelPacker.state_dict`` beside the pool, its
        ``buffer`` as restore keys)."""
        return self._book.state()

    def check_compatible(self, state: dict[str, Any]) -> None:
        """``BagelPacker.check_compatible``, and ``balance`` must be a balanced packer's record with one entry
        per buffered sample."""
        super().check_compatible(state)
        _check_book(state["balance"], "BalancedPacker.load_state_dict")
        if len(state["balance"]["since"]) != len(state["buffer"]):
            raise StateError(f"BalancedPacker.load_state_dict: {len(state['balance']['since'])} entry packs for "
                             f"{len(state['buffer'])} buffered samples")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``BagelPacker.load_state_dict`` (the pool rebuilt from its restore keys), then the pool's record; the
        samples' lengths and costs are measured again at the next pack."""
        super().load_state_dict(state)
        self._book = PoolBook.of_state(state["balance"])

    def _fill(self, fill: _PackFill) -> None:
        self.last_pack = self._balanced.fill(fill, self.buffer, self._book)

    def resize_state(self, olds: list[dict[str, Any]], ctx: ResizeContext, **kw: Any) -> dict[str, Any]:
        """``BagelPacker.resize_state`` (the pool is handed to the readers as the buffer is;
        docs/packing_ledger.md), plus ``balance``: on every new rank an empty pool, a pack count of 0 and the old
        world's summed cost and token sums (one common target from the first pack after the resize). Raises
        ``StateError`` (one line) for states that are not balanced packer states."""
        state = super().resize_state(olds, ctx)
        for i, old in enumerate(olds):
            _check_book(old["balance"], f"BalancedPacker.resize_state: old rank {i}")
        state["balance"] = PoolBook(seen_cost=float(sum(float(old["balance"]["seen_cost"]) for old in olds)),
                                    seen_tokens=sum(int(old["balance"]["seen_tokens"]) for old in olds)).state()
        return state

    def stats(self) -> dict[str, Any]:
        """``BagelPacker.stats()`` plus ``balance``: this rank's ``packs``, the ``target_flops`` of a pack, the
        ``flops_per_token`` it derives from (mean over the samples drawn), the ``last_pack_flops`` /
        ``last_pack_tokens`` the loop planned for the last pack and the ``pool_flops`` waiting."""
        book = self._book
        return {**super().stats(), "balance": {
            "packs": book.packs, "target_flops": self._balanced.target_cost(book),
            "last_pack_tokens": self.last_pack[0], "last_pack_flops": self.last_pack[1],
            "flops_per_token": book.cost_per_token, "pool_flops": sum(c for _, c in book.metrics or ())}}
