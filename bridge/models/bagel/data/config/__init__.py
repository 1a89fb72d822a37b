"""Configuration: everything a job is told, checked once.

* ``schema``: the data config (``BagelDataConfig``, an OmegaConf-structured dataclass), the packer knobs
  (``PackerConfig``, the one place their defaults live) and the official dataset registry.
* ``grouped_yaml``: the official grouped-datasets YAML (``configs/example.yaml`` format).
* ``budgets``: the packer's length rules and the config-time budget checks (cases B3/B4/B6).
* ``validate``: ``validate_data``, the one validation pass every entry point goes through.

Everything public is re-exported here (``from bridge.models.bagel.data.config import BagelDataConfig``).
"""

from .grouped_yaml import GROUP_KEYS, KNOWN_GROUPS, ConfigError, GroupConfig, load_grouped_yaml, resolve_path
from .schema import (DATA_PATH_KEYS, DEFAULT_PARTITIONS, OFFICIAL_NON_PACKER_KEYS, ORDERS, PACKER_BUDGET_KEYS,
                     PREFETCH_STARTS, REMOVED_ORDERS, STRATEGIES, BagelDataConfig, BalanceConfig, CostConfig,
                     DatasetInfoEntry, PackerConfig, ResolvedGroup, ValidDataConfig, config_parts, load_config,
                     load_dataset_info, resolve_groups, structured_merge)
from .validate import ValidatedData, validate_data

__all__ = [
    "DATA_PATH_KEYS", "DEFAULT_PARTITIONS", "GROUP_KEYS", "KNOWN_GROUPS", "OFFICIAL_NON_PACKER_KEYS", "ORDERS",
    "PACKER_BUDGET_KEYS", "PREFETCH_STARTS", "REMOVED_ORDERS", "STRATEGIES", "BagelDataConfig", "BalanceConfig",
    "CostConfig", "ConfigError", "DatasetInfoEntry", "GroupConfig", "PackerConfig", "ResolvedGroup", "ValidDataConfig",
    "ValidatedData",
    "config_parts", "load_config", "load_dataset_info", "load_grouped_yaml", "resolve_groups", "resolve_path",
    "structured_merge", "validate_data",
]
