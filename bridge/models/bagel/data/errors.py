"""The data errors a run can end with, from one base: each names where and what to do, with a short form for the
other ranks' line.

``DataError`` carries ``brief`` (one short line: what the other ranks print, ``job.topology.agree``) and pickles with
it (it crosses the prefetch producer's queue and Energon worker processes). Its kinds:

* ``DataReadError`` — reading a converted dataset failed (the damaged file and its remedy when one is found);
* ``DataTimeoutError`` — a read did not return within ``data.timeout_s`` (group, dataset, shard file, process);
* ``DataStallError`` — a source keeps dropping samples and can never yield one (where, why, what to change);
* ``CorruptShardError`` — too many samples of one shard failed their checksums: the shard is damaged (its file,
  dataset and the remedy).
"""

from __future__ import annotations

__all__ = ["FIRST_LINE_LIMIT", "CorruptShardError", "DataError", "DataReadError", "DataStallError", "DataTimeoutError",
           "error_lines", "shorten", "split_first_line"]

#: The longest first line of an error the job or a CLI prints; the detail goes on the following lines.
FIRST_LINE_LIMIT = 300
#: Where a long first line is broken, best first: after a sentence, a clause, a colon, a comma, a word.
_BREAKS = (". ", "; ", ": ", ", ", " ")


def split_first_line(text: str, limit: int = FIRST_LINE_LIMIT, *, prefix: int = 0) -> list[str]:
    """``text`` as lines whose first is at most ``limit - prefix`` characters: a longer first line is broken after
    the last sentence / clause / colon / comma / word that fits (never inside a word), the rest following on the
    next line; the other lines as they are. Whitespace inside a line is collapsed."""
    lines = [" ".join(line.split()) for line in str(text).splitlines() if line.strip()] or [""]
    room = max(limit - prefix, 40)
    first = lines[0]
    if len(first) <= room:
        return lines
    for sep in _BREAKS:
        cut = first.rfind(sep, 0, room - len(sep.rstrip()) + 1)
        if cut > room // 3:
            end = cut + len(sep.rstrip())
            return [first[:end], first[end:].strip(), *lines[1:]]
    return [first[:room], first[room:], *lines[1:]]  # one unbroken token: cut it


def shorten(text: str, limit: int = 160) -> str:
    """The first line of ``text``, at most ``limit`` characters, cut after a whole word (``…`` marks a cut)."""
    line = " ".join(str(text).splitlines()[0].split()) if str(text).strip() else ""
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit - 1)
    return (line[:cut] if cut > limit // 3 else line[: limit - 1]).rstrip(" ,;:") + "…"


def error_lines(rank: int, kind: str, message: str) -> list[str]:
    """What the job prints for a failing rank: ``error [rank R]: Kind: <first line>`` (at most
    ``FIRST_LINE_LIMIT`` characters) and the detail on the following lines, indented."""
    head = f"error [rank {rank}]: {kind}: "
    lines = split_first_line(message, prefix=len(head))
    return [head + lines[0], *("  " + line for line in lines[1:])]


class DataError(RuntimeError):
    """A data problem that ends the run: ``str(e)`` the full message, ``e.brief`` a short form (<= ~200 chars)."""

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or shorten(message, 160)

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.brief))


class DataReadError(DataError):
    """Reading a converted dataset failed: one line naming the damaged file and the remedy when one is found
    (``energon.layout.damage.diagnose``), else the group, datasets, rank and the cause (shard/key if known)."""


class DataTimeoutError(DataError):
    """A data read did not return within ``data.timeout_s``; names group, dataset, shard file and process."""


class DataStallError(DataError):
    """A source keeps dropping samples and can never yield one: the message names where, why and what to change."""


class CorruptShardError(DataError):
    """More than ``MAX_BAD_FRACTION`` of one shard's samples failed their checksums on one reader: the shard file is
    damaged (a bad copy, not a flipped bit here and there). Names the shard, its dataset and the remedy (re-copy or
    convert again; ``bagel-data verify``). Raised by ``energon.readers.core.ChecksumGuard``."""
