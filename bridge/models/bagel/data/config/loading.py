"""Loading a config: a YAML file's paths resolved against its directory and ``key=value`` overrides, as OmegaConf
parts (``config_parts``), merged by ``schema.structured_merge``; ``load_config`` for the data config. Errors name
the file or the override and the key.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .grouped_yaml import ConfigError, read_mapping, resolve_path
from .registry import resolve_registry_paths
from .schema import DATA_PATH_KEYS, BagelDataConfig, to_config

__all__ = ["config_parts", "load_config"]


def config_parts(path: str | os.PathLike | None, overrides: Sequence[str], path_keys: Sequence[str],
                 read: Any = None) -> tuple[list[Any], list[str]]:
    """The OmegaConf parts of a config file plus ``key=value`` overrides, and one name per part.

    ``path_keys`` (dotted) are resolved against the file's directory when relative (``resolve_path``);
    overrides are kept as typed (relative to the working directory). Each override is its own part, so an
    error names the one override at fault. ``read(path) -> dict`` reads the file (default ``read_mapping``).
    """
    from omegaconf import OmegaConf

    parts: list[Any] = []
    names: list[str] = []
    if path is not None:
        data = read(path) if read is not None else read_mapping(path, str(path))[0]
        base = os.path.dirname(os.path.abspath(path))
        for dotted in path_keys:
            *outer, last = dotted.split(".")
            node = data
            for k in outer:
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, dict) and last in node:
                node[last] = resolve_path(node[last], base)
                if last == "dataset_info" and isinstance(node[last], dict):  # an inline registry
                    resolve_registry_paths(node[last], base)
        parts.append(OmegaConf.create(data))
        names.append(str(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides: expected key=value, got {bad}")
    parts += [OmegaConf.from_dotlist([o]) for o in overrides]
    names += [f"override {o!r}" for o in overrides]
    return parts, names


def load_config(yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> BagelDataConfig:
    """Load a ``BagelDataConfig`` from a YAML file merged with ``key=value`` dotlist overrides.

    Relative ``groups`` / ``dataset_info`` paths in the file are relative to the file's directory; in an
    override, to the working directory. Raises ``ConfigError`` naming the file or override and the key.
    """
    parts, names = config_parts(yaml_path, overrides, DATA_PATH_KEYS)
    return to_config(parts, names or "<defaults>")
