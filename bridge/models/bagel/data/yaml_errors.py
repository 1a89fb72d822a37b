"""YAML parse errors as one line (an infrastructure leaf: the runtime's config loaders and the converter wing
both use it, so a bad YAML reads the same wherever it is parsed)."""

from __future__ import annotations

import yaml

__all__ = ["yaml_problem"]


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what is wrong and where (1-based line and column), without PyYAML's
    multi-line snippet (which names the text as ``"<unicode string>"`` when it was parsed from a string)."""
    mark = getattr(exc, "problem_mark", None)
    what = "; ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
    what = what or " ".join(str(exc).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what
