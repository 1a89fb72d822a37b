"""The resume fingerprint: what must match for a saved loader state to apply, built in this one place.

A loader's fingerprint is ``{"loader": <the data configuration's part>, "source": <the chain's part>,
"stateful_loaders": [...]}``. The configuration's part is what the builder knows changes the stream (``data.*``
settings, the groups, the DP rank and size: ``config.ValidatedData.fingerprint``). The chain's part is
:func:`fingerprint_of` the loader's source: every stage's ``identity()``, walked through ``source`` (a stage that
does not change the stream, like prefetch, answers with its source's fingerprint through its own ``fingerprint()``).
On restore, :func:`fingerprint_diff` names every differing key and :func:`mismatch_message` turns them into one
readable refusal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .protocol import StateError, tag_of

__all__ = ["ABSENT", "BUDGET_CHANGE_KEY", "ELASTIC_TOPOLOGY_KEYS", "FRESH_STREAM_KEY", "ResumeMismatchError",
           "fingerprint_changes", "fingerprint_diff", "fingerprint_of", "mismatch_message"]

#: Fingerprint keys the elastic order's stream does not depend on: the loader's DP rank/size and worker count,
#: and the RNG iterator's rank seed (a function of the DP rank).
ELASTIC_TOPOLOGY_KEYS = ("loader.dp_rank", "loader.dp_size", "loader.num_workers", "source.rank_seed")
#: The value ``fingerprint_changes`` reports for a key one of the two fingerprints does not have.
ABSENT = "<absent>"


class ResumeMismatchError(StateError):
    """A saved loader state was produced under a different configuration (fingerprint differs)."""


def fingerprint_of(obj: Any) -> dict[str, Any]:
    """``{"stage": tag, **obj.identity(), "source": <fingerprint of each source>}`` (JSON-like, no paths).

    An object with its own ``fingerprint()`` method answers for itself (a transparent stage gives its source's)."""
    own = getattr(obj, "fingerprint", None)
    if callable(own):
        return own()
    identity = getattr(obj, "identity", None)
    out: dict[str, Any] = {"stage": tag_of(obj), **(identity() if callable(identity) else {})}
    source = getattr(obj, "source", None)
    if isinstance(source, (list, tuple)):
        out["source"] = [fingerprint_of(s) for s in source]
    elif source is not None:
        out["source"] = fingerprint_of(source)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        for k in value:
            _flatten(value[k], f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
        if not value:
            out[prefix] = []
    else:
        out[prefix] = value
    return out


def fingerprint_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                        ignore: Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """Every key (dotted path, sorted) whose value differs between two fingerprints -> ``(saved, current)`` (``ABSENT``
    where one side lacks the key); keys in ``ignore`` (exact dotted paths) are not compared."""
    a, b = _flatten(saved, "", {}), _flatten(current, "", {})
    skip = set(ignore)
    return {k: (a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b))
            if k not in skip and a.get(k, ABSENT) != b.get(k, ABSENT)}


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """Every key (dotted path) whose value differs between two fingerprints, as ``key: saved=… current=…``;
    keys in ``ignore`` (exact dotted paths) are not compared."""
    changes = fingerprint_changes(saved, current, ignore)
    return [f"{k}: saved={old!r} current={new!r}" for k, (old, new) in changes.items()]


#: The key that starts the data stream fresh while the model resumes (``BagelDataConfig.fresh_stream``).
FRESH_STREAM_KEY = "data.fresh_stream"
#: The key that lets a resume change the packer budgets (``BagelDataConfig.resume_budget_change``).
BUDGET_CHANGE_KEY = "data.resume_budget_change"
#: A refused restore names at most this many differing keys, each cut to _DIFF_CHARS characters.
_DIFF_SHOWN, _DIFF_CHARS = 8, 240
#: Loader keys that only the elastic order lets a run change across a restart.
_ELASTIC_KEYS = ("loader.num_workers:", "loader.dp_size:", "loader.dp_rank:")


def mismatch_message(diff: list[str], note: str = "") -> str:
    """The ``ResumeMismatchError`` text for ``fingerprint_diff`` lines: the configuration keys (``loader.*``:
    ``data.*`` settings, the groups, DP size; ``data.*``: a stage's knob by its configuration name) first, the stage
    keys that follow from them only counted, long values cut, and what to do, so the line stays readable however
    much differs. ``note``: a last line of the caller's (what a budget change would need, or why it is refused)."""
    config = [d for d in diff if d.startswith(("loader.", "data."))]
    shown = (config or diff)[:_DIFF_SHOWN]
    cut = [d if len(d) <= _DIFF_CHARS else d[: _DIFF_CHARS - 1] + "…" for d in shown]
    rest = len(diff) - len(shown)
    if rest:
        cut.append(f"(+{rest} more: keys of the stages" + (", which follow from these)" if config else ")"))
    remedy = ("restore with the data configuration this state was saved with, or keep the change and start the data "
              f"stream fresh while the model resumes: {FRESH_STREAM_KEY}=true (docs/resume.md)")
    if any(d.startswith(_ELASTIC_KEYS) for d in config) and not any(d.startswith("loader.order:") for d in config):
        remedy += ("; only data.order: elastic lets a run change DP size or data.num_workers across a restart "
                   "(docs/elastic.md)")
    return ("BagelExternalLoader.restore_state: the saved loader state belongs to a different data configuration; "
            "differing keys:\n  " + "\n  ".join(cut) + f"\n{remedy}" + (f"\n{note}" if note else ""))
