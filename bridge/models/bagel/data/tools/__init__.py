"""Command-line tools over the same builder the job uses: ``bagel-data`` (``cli``), ``inspect`` (``inspection``)
and ``stats`` (``budget_stats``). Nothing in the runtime imports them."""

from collections.abc import Collection, Sequence


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[int] = (0,)) -> list[str]:
    """Text table lines: the ``left`` columns left-aligned, the others right-aligned, a dashed rule under the head."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i in left else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head).rstrip(), "  ".join("-" * w for w in widths)] + [fmt.format(*r).rstrip() for r in rows]
