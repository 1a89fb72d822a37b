"""The only module that imports Megatron-Bridge (lazily); the provider classes built on it live in ``providers``.

Every ``megatron.bridge`` import runs the package ``__init__``, which reaches
``megatron.bridge.peft.lora_layers`` and its unconditional ``import transformer_engine.pytorch``. Where
Transformer Engine is not installed (CPU machines), ``import_bridge()`` first registers a stand-in for that
one module whose LoRA classes refuse construction; nothing else changes and Transformer Engine itself is
never faked (Megatron-Core would then believe it is present).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Any

__all__ = ["BridgeAPI", "BridgeNotInstalledError", "BridgeTrainingAPI", "import_bridge", "import_bridge_training",
           "install_lora_layers_standin"]

logger = logging.getLogger(__name__)

_LORA_MODULE = "megatron.bridge.peft.lora_layers"
_LORA_CLASSES = ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear")


def _refusing_class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{name} needs transformer_engine (GPU build), which is not installed; LoRA PEFT is unavailable here"
        )

    return type(name, (), {"__init__": __init__, "__module__": _LORA_MODULE,
                           "__doc__": f"Stand-in for {name}: transformer_engine is not installed."})


def install_lora_layers_standin() -> bool:
    """Register the ``lora_layers`` stand-in when Transformer Engine is absent; True if it was installed."""
    if importlib.util.find_spec("transformer_engine") is not None or _LORA_MODULE in sys.modules:
        return False
    module = types.ModuleType(_LORA_MODULE, "Stand-in: transformer_engine is not installed (CPU).")
    for name in _LORA_CLASSES:
        setattr(module, name, _refusing_class(name))
    sys.modules[_LORA_MODULE] = module
    logger.info("transformer_engine is not installed: registered a stand-in for %s (LoRA layers refuse "
                "construction; everything else in Megatron-Bridge is the real code)", _LORA_MODULE)
    return True


@dataclasses.dataclass(frozen=True)
class BridgeAPI:
    """The Megatron-Bridge pieces this package uses (checkpoint helpers are None where unimportable)."""

    MegatronMIMODatasetProvider: type
    DatasetProvider: type
    DatasetBuildContext: type
    build_pretraining_data_loader: Any
    energon_torch_load: Any
    maybe_save_dataloader_state: Any
    maybe_load_dataloader_state: Any
    checkpointing_error: str | None
    get_checkpoint_name: Any = None   # Bridge's iter_NNNNNNN directory naming (None where unimportable)
    make_data_iterator_list: Any = None  # per-model-chunk iterators of an interleaved (virtual) pipeline


#: what to install when Megatron-Bridge is missing (docs/install.md)
INSTALL_HINT = "pip install 'bagel-megatron-data[bridge]' (on a machine without CUDA: docs/install.md)"


class BridgeNotInstalledError(ModuleNotFoundError):
    """Megatron-Bridge (or one of the modules it imports) is not installed; the message is one line naming
    the ``bridge`` extra. A ``ModuleNotFoundError``, so ``except ImportError`` still catches it."""


def _not_installed(exc: ModuleNotFoundError) -> BridgeNotInstalledError:
    """One line for a failed ``megatron.bridge`` import: Bridge missing, too old, or missing a module it needs."""
    missing = exc.name or ""
    try:
        version: str | None = importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        version = None
    ours = missing == "megatron" or missing.split(".")[:2] == ["megatron", "bridge"]
    if ours and (version is None or importlib.util.find_spec("megatron.bridge") is None):
        return BridgeNotInstalledError(
            "Megatron-Bridge is not installed; the Bridge providers, the job and its checkpoints need it, "
            f"from this package's 'bridge' extra: {INSTALL_HINT}", name="megatron.bridge")
    if ours:
        return BridgeNotInstalledError(
            f"Megatron-Bridge {version} has no module {missing!r}: this package needs megatron-bridge>=0.6 "
            f"(MegatronMIMODatasetProvider); upgrade it with the 'bridge' extra: {INSTALL_HINT}", name=missing)
    return BridgeNotInstalledError(
        f"Megatron-Bridge {version} is installed but importing it failed: no module named {missing!r}, one of its "
        f"own requirements (left out by 'pip install --no-deps'?); install it, or the 'bridge' extra: {INSTALL_HINT}",
        name=missing or None)


@functools.cache
def import_bridge() -> BridgeAPI:
    """Import Megatron-Bridge (installing the CPU stand-in first where needed) and return what we use.

    ``maybe_save/load_dataloader_state`` live only in ``megatron.bridge.training.checkpointing``, which
    imports ``modelopt`` (package ``nvidia-modelopt``) at module level; without it they are None and
    ``checkpointing_error`` says why.

    Raises ``BridgeNotInstalledError`` (a ``ModuleNotFoundError``), one line naming the ``bridge`` extra, when
    Megatron-Bridge or a module it imports is not installed.
    """
    install_lora_layers_standin()
    # Bridge's optional-import helper logs every missing optional symbol (with a traceback) at INFO through
    # its own handler; keep warnings and errors, drop that noise.
    logging.getLogger("megatron.bridge.utils.import_utils").addFilter(lambda rec: rec.levelno >= logging.WARNING)
    try:
        base_provider = importlib.import_module("megatron.bridge.data.megatron_mimo.base_provider")
    except ModuleNotFoundError as exc:
        raise _not_installed(exc) from None
    data_base = importlib.import_module("megatron.bridge.data.base")
    samplers = importlib.import_module("megatron.bridge.data.samplers")
    safe_pickle = importlib.import_module("megatron.bridge.utils.safe_pickle")
    iterator_utils = importlib.import_module("megatron.bridge.data.iterator_utils")
    save = load = checkpoint_name = error = None
    try:
        ckpt = importlib.import_module("megatron.bridge.training.checkpointing")
        save, load = ckpt.maybe_save_dataloader_state, ckpt.maybe_load_dataloader_state
        checkpoint_name = ckpt.get_checkpoint_name
    except ImportError as exc:  # e.g. nvidia-modelopt missing
        error = f"megatron.bridge.training.checkpointing is not importable: {exc}"
        logger.warning("%s (the 'bridge' extra brings nvidia-modelopt: pip install 'bagel-megatron-data[bridge]')",
                       error)
    return BridgeAPI(
        MegatronMIMODatasetProvider=base_provider.MegatronMIMODatasetProvider,
        DatasetProvider=data_base.DatasetProvider, DatasetBuildContext=data_base.DatasetBuildContext,
        build_pretraining_data_loader=samplers.build_pretraining_data_loader,
        energon_torch_load=safe_pickle.energon_torch_load, maybe_save_dataloader_state=save,
        maybe_load_dataloader_state=load, checkpointing_error=error, get_checkpoint_name=checkpoint_name,
        make_data_iterator_list=iterator_utils.make_data_iterator_list)


@dataclasses.dataclass(frozen=True)
class BridgeTrainingAPI:
    """Megatron-Bridge's training side, for recipes and ``pretrain()`` (the model package's provider and the
    launcher's ``--recipe`` path). ``pretrain`` is None where ``megatron.bridge.training.pretrain`` cannot be
    imported (it needs ``nvidia-resiliency-ext``, a GPU-stack package); ``error`` says why."""

    GPTModelProvider: type
    ConfigContainer: type
    TrainingConfig: type
    ValidationConfig: type
    OptimizerConfig: type
    SchedulerConfig: type
    LoggerConfig: type
    TokenizerConfig: type
    CheckpointConfig: type
    RNGConfig: type
    DistributedDataParallelConfig: type
    pretrain: Any
    error: str | None


@functools.cache
def import_bridge_training() -> BridgeTrainingAPI:
    """Import Bridge's model-provider and training-config classes (after ``import_bridge``'s CPU stand-in)."""
    import_bridge()
    gpt = importlib.import_module("megatron.bridge.models.gpt_provider")
    config = importlib.import_module("megatron.bridge.training.config")
    pretrain, error = None, None
    try:
        pretrain = importlib.import_module("megatron.bridge.training.pretrain").pretrain
    except ImportError as exc:  # nvidia_resiliency_ext (GPU stack) on CPU machines
        error = f"megatron.bridge.training.pretrain is not importable: {exc}"
    return BridgeTrainingAPI(
        GPTModelProvider=gpt.GPTModelProvider, ConfigContainer=config.ConfigContainer,
        TrainingConfig=config.TrainingConfig, ValidationConfig=config.ValidationConfig,
        OptimizerConfig=config.OptimizerConfig, SchedulerConfig=config.SchedulerConfig,
        LoggerConfig=config.LoggerConfig, TokenizerConfig=config.TokenizerConfig,
        CheckpointConfig=config.CheckpointConfig, RNGConfig=config.RNGConfig,
        DistributedDataParallelConfig=config.DistributedDataParallelConfig, pretrain=pretrain, error=error)
