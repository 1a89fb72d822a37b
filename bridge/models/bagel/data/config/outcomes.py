"""What a converted sample can become: the one home of that rule, per group type (spec §4.3-§4.5, §5).

A cooked sample is a ``sequence_plan``: text, ``vae_image`` and ``vit_image`` items, each with its tokens (text
ids; image patches or latents) and two special tokens. Which items a row gives depends on the reader's random
draws (t2i: the caption; unified_edit: start, end, the concatenated variant and an instruction per step). An
:class:`Outcome` is one way a row can be laid out, with its probability over those draws; the functions below
enumerate them for a row of known sizes:

* :func:`t2i_outcomes`: [caption text, noised VAE image] (one outcome; the caption over its alternatives);
* :func:`edit_outcomes`: every (start, end, variant) of :func:`edit_draws`, laid out by :func:`edit_parts`;
  the edit cooker (``energon.cooking.edit``) draws through :func:`edit_end_choices` / :func:`may_concat` and lays
  out the row by the same :func:`edit_parts` (``tests/test_cookers.py`` checks: same draws, same layout);
* :func:`vlm_outcome`: the conversation's elements in order (no draws).

Everything else derives from the outcomes: the packer's token estimate (:attr:`Outcome.lo` / ``hi`` / ``mean``,
``lengths.estimate`` of the items; the budget checks' bounds in ``budgets.group_bounds``, ``bagel-data stats``'
per-sample estimates) and the work a sample asks of the model (``packing.cost.expected_work``: the straggler
prediction's cost). Units: tokens = packed sequence positions; a text's tokens are a :class:`Text` (over the
alternatives the reader chooses from), an image's an int.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from .lengths import estimate

__all__ = ["CONCAT_P", "EditImage", "EditText", "Item", "Outcome", "Text", "edit_draws", "edit_end_choices",
           "edit_outcomes", "edit_parts", "may_concat", "summary", "t2i_outcomes", "vlm_outcome"]

#: The probability of the concatenated variant of an edit row when it is possible (official ``random() < 0.5``).
CONCAT_P = 0.5


class Text(NamedTuple):
    """A text item's tokens over the reader's choices: ``lo`` / ``hi`` / ``mean``; ``alts`` the equally likely
    lengths when the text is one choice among them (t2i's caption: the work is then the exact expectation over
    them), empty where choices combine (an edit's instructions: the work uses the mean length)."""

    lo: int
    hi: int
    mean: float
    alts: tuple[int, ...] = ()

    @classmethod
    def of(cls, lens: Sequence[int]) -> "Text":
        """One uniform choice among texts of ``lens`` tokens (non-empty)."""
        return cls(min(lens), max(lens), sum(lens) / len(lens), tuple(lens))


class Item(NamedTuple):
    """One ``sequence_plan`` item: ``type`` (``text`` / ``vae_image`` / ``vit_image``), ``tokens`` without its
    two special tokens (a :class:`Text` or an int), ``loss`` (1: the noised VAE target)."""

    type: str
    tokens: int | Text
    loss: int = 0


class Outcome(NamedTuple):
    """One layout of a row and its ``probability``; ``unplaced``: image tokens counted in ``num_tokens`` that no
    plan item packs (vlm images without a placeholder, quirk §13.14)."""

    probability: float
    items: tuple[Item, ...]
    unplaced: int = 0

    def _estimate(self, text: Callable[[Text], float]) -> float:
        """``lengths.estimate`` of the items, each text counting ``text(its Text)`` tokens."""
        fixed = self.unplaced + sum(i.tokens for i in self.items if not isinstance(i.tokens, Text))
        return estimate(fixed, len(self.items)) + sum(text(i.tokens) for i in self.items if isinstance(i.tokens, Text))

    @property
    def lo(self) -> int:
        """The packer's estimate (``lengths.estimate``) with every text at its shortest."""
        return self._estimate(lambda t: t.lo)

    @property
    def hi(self) -> int:
        """The estimate with every text at its longest."""
        return self._estimate(lambda t: t.hi)

    @property
    def mean(self) -> float:
        """The estimate's expectation over the texts' choices."""
        return self._estimate(lambda t: t.mean)


def summary(outcomes: Sequence[Outcome]) -> tuple[int, int, float]:
    """(lowest, highest, expected) estimate of a row over all its outcomes (tokens)."""
    return (min(o.lo for o in outcomes), max(o.hi for o in outcomes),
            sum(o.probability * o.mean for o in outcomes))


# --------------------------------------------------------------------------------------------------
# t2i_pretrain and vlm_sft


def t2i_outcomes(image_tokens: int, caption_lens: Sequence[int]) -> list[Outcome]:
    """t2i_pretrain (``T2IIterableDataset``): the caption (one ``choice`` over ``caption_lens``, the tokenized
    captions; ``[len(encode(' '))]`` without captions), then the noised VAE image of ``image_tokens`` latents."""
    return [Outcome(1.0, (Item("text", Text.of(caption_lens)), Item("vae_image", image_tokens, 1)))]


def vlm_outcome(elements: Iterable[tuple[str, int]], image_tokens: Sequence[int]) -> Outcome:
    """vlm_sft (``SftJSONLIterableDataset``, no draws): ``elements`` are the conversation's (kind, tokens) in
    order (``energon.cooking.vlm.conversation_elements``: ``text`` with its token count, empty texts packed as
    nothing; ``image`` the next image of ``image_tokens``); every image of the record counts in ``num_tokens``,
    also those without a placeholder (``unplaced``)."""
    items, k = [], 0
    for kind, n in elements:
        if kind != "text":
            items.append(Item("vit_image", image_tokens[k]))
            k += 1
        elif n:
            items.append(Item("text", int(n)))
    return Outcome(1.0, tuple(items), sum(image_tokens[k:]))


# --------------------------------------------------------------------------------------------------
# unified_edit (``UnifiedEditIterableDataset.parse_row``, spec §4.5)


class EditImage(NamedTuple):
    """Image ``image`` of an edit row: its noised VAE target (``loss``) and/or its clean VAE + ViT copy
    (``clean``), in that order (the cooker's ``need_loss`` / ``need_vae`` and ``need_vit``)."""

    image: int
    loss: bool
    clean: bool


class EditText(NamedTuple):
    """The instruction of ``steps`` (``instruction_list`` indexes): one chosen alternative, or (``joined``) one
    per step, each followed by ``". "``, the whole right-stripped (the concatenated variant)."""

    steps: tuple[int, ...]
    joined: bool


def edit_end_choices(n: int, start: int) -> int:
    """How many ends ``start`` allows in a row of ``n`` images: ``end`` is drawn from ``range(start + 1,
    min(start + 3, n))`` (``start`` from ``range(n - 1)``)."""
    return min(start + 3, n) - (start + 1)


def may_concat(start: int, end: int) -> bool:
    """Whether the concatenated variant is drawn for (``random() < CONCAT_P``): only when ``end - start > 1``."""
    return end - start > 1


def edit_parts(n: int, start: int, end: int, concat: bool) -> list[EditImage | EditText]:
    """The layout of a draw, in plan order. Always first the context: image ``start`` clean. Concatenated: the joined
    instructions then image ``end`` noised, ``end`` pulled back by one when it is the last image. Stepwise: per step
    ``i`` in ``start+1 .. end`` its instruction, then image ``i`` noised, and clean unless it is ``end``."""
    parts: list[EditImage | EditText] = [EditImage(start, False, True)]
    if concat:
        end = end - 1 if end == n - 1 else end
        return parts + [EditText(tuple(range(start, end)), True), EditImage(end, True, False)]
    for i in range(start + 1, end + 1):
        parts += [EditText((i - 1,), False), EditImage(i, True, i != end)]
    return parts


def edit_draws(n: int) -> list[tuple[float, int, int, bool]]:
    """Every (probability, start, end, concat) the edit reader can draw for a row of ``n >= 2`` images: start
    uniform, end uniform over :func:`edit_end_choices`, concatenated with :data:`CONCAT_P` when
    :func:`may_concat`. Raises ValueError for ``n < 2``."""
    if n < 2:
        raise ValueError(f"an edit row needs at least 2 images, got {n}")
    out = []
    for s in range(n - 1):
        k = edit_end_choices(n, s)
        for e in range(s + 1, s + 1 + k):
            p = 1.0 / (n - 1) / k
            if may_concat(s, e):
                out += [(p * CONCAT_P, s, e, True), (p * (1 - CONCAT_P), s, e, False)]
            else:
                out.append((p, s, e, False))
    return out


def edit_outcomes(vae_tokens: Sequence[int], vit_tokens: Sequence[int], text_lens: Callable[[int], Text],
                  concat_lens: Callable[[list[int]], Text]) -> list[Outcome]:
    """Every layout of an edit row of ``n = len(vae_tokens)`` images (:func:`edit_draws`, :func:`edit_parts`).

    ``vae_tokens[i]`` / ``vit_tokens[i]``: tokens of image ``i`` after the VAE / ViT transform;
    ``text_lens(step)``: the :class:`Text` of one alternative of ``instruction_list[step]``;
    ``concat_lens(steps)``: of the joined text of those steps. Raises ValueError for ``n < 2``.
    """
    out = []
    for p, s, e, concat in edit_draws(len(vae_tokens)):
        items: list[Item] = []
        for part in edit_parts(len(vae_tokens), s, e, concat):
            if isinstance(part, EditText):
                items.append(Item("text", concat_lens(list(part.steps)) if part.joined else text_lens(part.steps[0])))
                continue
            if part.loss:
                items.append(Item("vae_image", vae_tokens[part.image], 1))
            if part.clean:
                items += [Item("vae_image", vae_tokens[part.image]), Item("vit_image", vit_tokens[part.image])]
        out.append(Outcome(p, tuple(items)))
    return out
