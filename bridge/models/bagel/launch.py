"""The main job's launcher: ``torchrun --nproc-per-node=N -m bridge.models.bagel.launch [key=value ...]``.

Also the console script ``bagel-train`` and ``scripts/pretrain_bagel.py`` (a thin shim). It composes the data job
(``data.job.runner.run_job``) with the model (``model.trainer.BagelTrainer``), which the data package never
imports:

* **CPU / any device, the job's own loop** (default): gloo (NCCL with CUDA) + Megatron-Core process groups; every
  step pulls the micro-batches Megatron would pull through Bridge's external-loader path, checks them against
  the batch contract, and — when ``model.name`` selects a model — trains it (``BagelTrainer``: Bridge's forward
  step, deterministic DP gradient averaging, AdamW). ``model.name: null`` (the default) is the data-only job.
  Checkpoints (``train.save``) hold the loader state (Bridge's files), model and optimizer; ``train.load``
  resumes both, bit-exact at the same DP size.
* **GPU, Megatron-Bridge's own ``pretrain()``** (``--recipe MODULE:FUNCTION [--forward-step MODULE:NAME]``): the
  recipe returns a Bridge ``ConfigContainer`` (e.g. ``bridge.models.bagel.model.provider:bagel_tiny_recipe``);
  its dataset becomes ``BagelDatasetProvider`` over this job's ``data`` section and the forward step defaults to
  ``bridge.models.bagel.model.step:forward_step``. The recipe owns ``train_iters``, the batch sizes and the
  parallel layout (TP/PP/CP/VPP): they are taken from it, and a ``train.<key>=`` override on the command line
  that disagrees is refused in one line (``reconcile_recipe``). Validation is the recipe's too
  (``validation.eval_interval`` / ``eval_iters``, copied to ``train.eval_*``): with ``data.valid`` set the provider
  hands Bridge a validation stream that restarts at every evaluation; without it a recipe that asks for
  validation is refused, and one INFO line says validation is off.

Config: ``--config configs/demo.yaml`` (default) plus OmegaConf ``key=value`` overrides, e.g.
``model.name=bagel-tiny train.train_iters=20 data.packer.use_flex=false train.load=runs/demo/ckpt``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["RECIPE_KEYS", "RECIPE_VALIDATION_KEYS", "attempt_store", "main", "model_config", "reconcile_recipe"]

logger = logging.getLogger("bagel.launch")

#: ``train.*`` keys the recipe owns under ``--recipe`` → where the ``ConfigContainer`` holds them.
RECIPE_KEYS: dict[str, tuple[str, str]] = {
    "train_iters": ("train", "train_iters"),
    "global_batch_size": ("train", "global_batch_size"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "tensor_model_parallel_size": ("model", "tensor_model_parallel_size"),
    "pipeline_model_parallel_size": ("model", "pipeline_model_parallel_size"),
    "context_parallel_size": ("model", "context_parallel_size"),
    "virtual_pipeline_model_parallel_size": ("model", "virtual_pipeline_model_parallel_size"),
}


#: ``train.*`` validation keys the recipe owns under ``--recipe`` → ``ConfigContainer.validation`` attribute
#: (None there = 0 here); not reported as changed (the job's defaults differ from a recipe without validation).
RECIPE_VALIDATION_KEYS: dict[str, str] = {"eval_interval": "eval_interval", "eval_iters": "eval_iters"}


def _default_config() -> str:
    """``configs/demo.yaml`` of the checkout this module runs from (cwd-relative ``configs/demo.yaml`` otherwise)."""
    candidate = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
    return str(candidate if candidate.is_file() else Path("configs") / "demo.yaml")


def _load_symbol(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"expected MODULE:NAME, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def model_config(section: dict[str, Any], source: str = "model") -> Any:
    """The job's ``model:`` section checked against ``BagelModelConfig`` (unknown keys refused, named)."""
    from .data.config import structured_merge
    from .model.config import BagelModelConfig

    return structured_merge(BagelModelConfig, [section or {}], source)


def reconcile_recipe(container: Any, train: Any, explicit: set[str], *, has_valid: bool = False) -> list[str]:
    """Make the job's ``train`` agree with a Bridge recipe's ``container`` before anything is built.

    The recipe's ``train_iters``, ``global_batch_size``, ``micro_batch_size`` and TP/PP/CP/VPP (``RECIPE_KEYS``)
    are copied into ``train``; a key the user set explicitly on the command line (``explicit``: ``train.<key>=``
    overrides) that differs from the recipe raises ``ConfigError`` in one line naming both values; the same
    holds for the validation keys (``RECIPE_VALIDATION_KEYS``: ``validation.eval_interval`` / ``eval_iters``, None
    read as 0). A recipe without ``train_iters`` is refused, and so is one with validation configured
    (``eval_iters`` > 0 and an ``eval_interval``) when ``has_valid`` is False (``data.valid`` not set: no
    validation split). Returns the keys of ``RECIPE_KEYS`` taken from the recipe whose value differed from the job
    config's (for one INFO line).
    """
    from .data.config import ConfigError

    recipe = {key: getattr(getattr(container, part), attr, None) for key, (part, attr) in RECIPE_KEYS.items()}
    if recipe["train_iters"] is None:
        raise ConfigError("--recipe: the recipe sets no train.train_iters (train_samples / num_epochs are not used "
                          "with the external BAGEL loader): set cfg.train.train_iters in the recipe")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        recipe[key] = recipe[key] or 1
    validation = getattr(container, "validation", None)
    evals = {key: int(getattr(validation, attr, 0) or 0) for key, attr in RECIPE_VALIDATION_KEYS.items()}
    owned = {**recipe, **evals}
    clash = [f"train.{k}={getattr(train, k)!r} but the recipe has {owned[k]!r}" for k in sorted(explicit & set(owned))
             if getattr(train, k) != owned[k]]
    if clash:
        raise ConfigError(f"--recipe: {'; '.join(clash)}: the recipe owns these keys; drop the override or change the "
                          "recipe")
    if evals["eval_iters"] > 0 and evals["eval_interval"] > 0 and not has_valid:
        raise ConfigError(f"--recipe: the recipe asks for validation (validation.eval_iters={evals['eval_iters']}, "
                          f"eval_interval={evals['eval_interval']}) but data.valid is not set, so there is no "
                          "validation split: set data.valid (docs/configuration.md) or cfg.validation.eval_iters = 0 "
                          "in the recipe")
    changed = [k for k in RECIPE_KEYS if getattr(train, k) != recipe[k]]
    for key, value in owned.items():
        setattr(train, key, value)
    train.validate()
    return changed


def _init_distributed(train: Any) -> Any:
    import torch
    import torch.distributed as dist

    from .data.job.topology import init_model_parallel

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # plain `python -m bridge.models.bagel.launch`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group(backend=backend, store=attempt_store(), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    return init_model_parallel(train)


def attempt_store() -> Any:
    """The process-group store of this torchrun attempt: the ``env://`` rendezvous store (under torchrun, the
    agent's own TCP store, which lives across the attempts of ``--max-restarts``) behind a ``PrefixStore`` keyed by
    ``TORCHELASTIC_RESTART_COUNT``.

    Without the prefix a restarted attempt finds the previous attempt's keys (gloo's per-rank addresses, the
    barrier counters) in the shared store and connects to ranks that are gone: ``init_process_group`` fails with
    "Gloo connectFullMesh failed ... Connection refused" (pytorch issues #135712, #167288). Each attempt's keys
    live under their own prefix, so attempt N never reads attempt N-1's. Outside torchrun the count is 0: one
    prefix, nothing changes.
    """
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
    return dist.PrefixStore(f"bagel_attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/default_pg", store)


def _exit_together_if_all_ranks_failed(exc: BaseException) -> None:
    """After an error every rank raised together: wait until all ranks have printed, then leave at once.

    torchrun stops the remaining workers as soon as one exits non-zero, so a slow interpreter teardown would
    end in SIGTERM instead of exit status 1; every rank has reported and synchronised here, nothing is lost.
    """
    import torch.distributed as dist

    if not (getattr(exc, "all_ranks", False) and dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - exiting anyway
        return
    if dist.get_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)


def _prepare_demo_data(cfg: Any) -> None:
    import torch.distributed as dist

    from .data.converter.demo import make_demo_data

    if dist.get_rank() == 0:
        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    dist.barrier()


def _run_bridge_pretrain(cfg: Any, tokenizer: Any, container: Any, forward_step: str) -> None:
    """GPU path: the recipe's ``ConfigContainer`` with ``BagelDatasetProvider`` over ``cfg.data`` into Bridge's
    own ``pretrain()`` (which builds the loader from its DP group and saves / restores its state itself)."""
    from .data._bridge import import_bridge_training
    from .data.job.startup import resume_gc
    from .data.providers import BagelDatasetProvider

    api = import_bridge_training()
    if api.pretrain is None:
        raise RuntimeError(f"--recipe needs Megatron-Bridge's pretrain(), which is not importable here: {api.error}")
    container.dataset = BagelDatasetProvider(data=cfg.data, tokenizer=tokenizer)
    _announce_validation(cfg, container)
    if cfg.train.save:
        container.checkpoint.save = cfg.train.save
    if cfg.train.load:
        container.checkpoint.load = cfg.train.load
    resume_gc()  # pretrain() builds its loader and trains: the collector runs as usual there
    api.pretrain(config=container, forward_step_func=_load_symbol(forward_step))


def _announce_validation(cfg: Any, container: Any) -> None:
    """One INFO line (rank 0) on what Bridge's ``pretrain()`` will validate on. Without ``data.valid`` the recipe's
    validation is off (``reconcile_recipe`` refused one that asked for it; ``eval_iters`` is set to 0 so Bridge
    builds no valid split)."""
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    validation = getattr(container, "validation", None)
    if cfg.data.valid is None:
        if validation is not None:
            validation.eval_iters = 0
        if rank0:
            logger.info("validation is off: data.valid is not set")
    elif validation is None or not (validation.eval_iters or 0) or not validation.eval_interval:
        if rank0:
            logger.info("validation is off: data.valid is set but the recipe's validation.eval_iters / eval_interval "
                        "is not (set them in the recipe)")
    elif rank0:
        logger.info("validation: every %d steps, %d iterations on data.valid (the same batches at every evaluation; no "
                    "test split)", validation.eval_interval, validation.eval_iters)


def _explicit_train_keys(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0][len("train."):] for o in overrides if o.startswith("train.") and "=" in o}


def main(argv: list[str] | None = None) -> int:
    """Run the job (module docstring); 0 on success, 1 after one ``error [rank R]: Kind: message`` line per rank.

    Called as the program (``argv`` None), it does not return: the process ends here with ``code`` once the
    exit handlers ran (``_end_process``), without the interpreter's finalization.
    """
    from .data.job.startup import pause_gc, resume_gc

    pause_gc()  # until the loader is built (run_job, or before Bridge's pretrain()): job.startup
    ap = argparse.ArgumentParser(prog="bagel-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=_default_config(),
                    help="job YAML: data.* + train.* + model.* (relative paths in it are relative to the file; "
                         "default: %(default)s)")
    ap.add_argument("--digest-log", help="append one sha256 (and the step loss) per batch per rank to this JSONL file")
    ap.add_argument("--recipe", help="GPU: MODULE:FUNCTION returning a Megatron-Bridge ConfigContainer")
    ap.add_argument("--forward-step", default="bridge.models.bagel.model.step:forward_step",
                    help="GPU: MODULE:NAME of the forward step for Bridge's pretrain() (default: %(default)s)")
    ap.add_argument("--debug", action="store_true", help="show full tracebacks")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (OmegaConf dotlist)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron", "torch", "bridge.models.bagel.data._bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # torch's C++-extension helper warns "No CUDA runtime is found" on every CPU process at import: nothing the
    # job uses or the user can act on (a GPU machine has the runtime).
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    if rank != 0:  # once-per-job notices are rank 0's: the same text from every rank says nothing more
        for category in (FutureWarning, DeprecationWarning):  # e.g. torch's deprecations, raised at import
            warnings.filterwarnings("ignore", category=category)
        logging.getLogger("bridge.models.bagel.data.parity").setLevel(logging.ERROR)  # the unproven-versions note
    try:
        code = _main(args, rank)
    except Exception as exc:  # one clear line per failing rank; --debug for the traceback
        if args.debug:
            raise
        from .data.errors import error_lines

        # A first line of at most 300 characters, the detail on the following lines; one write for all of them:
        # ranks share torchrun's stderr pipe, and print() writes the newline separately.
        lines = error_lines(rank, getattr(exc, "kind", type(exc).__name__), str(exc))
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        _exit_together_if_all_ranks_failed(exc)
        code = 1
    finally:
        import torch.distributed as dist

        resume_gc()  # when start-up failed before run_job resumed it (a caller's process goes on)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if argv is None:
        _end_process(code)
    return code


def _main(args: argparse.Namespace, rank: int) -> int:
    from .data.job.config import validate_job  # torch, the config schema: no Megatron yet
    from .data.job.startup import StartupClock

    clock = StartupClock()  # from this process's start: the imports above are its first phase
    clock.mark("imports")
    overrides = list(args.overrides) + ([f"train.digest_log={args.digest_log}"] if args.digest_log else [])
    cfg, model_cfg, container, data = _configure(args, overrides, rank)
    clock.mark("config")
    import megatron.core.parallel_state  # noqa: F401  (timed apart from the process groups it then builds)

    from .data.job.runner import run_job
    from .data.tokenizer import add_special_tokens, load_tokenizer

    clock.mark("Megatron-Core import")
    pg_collection = _init_distributed(cfg.train)
    clock.mark("process groups")
    if cfg.demo_data:
        _prepare_demo_data(cfg)
        data = validate_job(cfg)
        clock.mark("demo data")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    clock.mark("tokenizer")
    if container is not None:
        _run_bridge_pretrain(cfg, tokenizer, container, args.forward_step)
        return 0
    trainer = None
    if model_cfg.enabled:
        import torch

        from .data.config import ConfigError
        from .data.job.topology import agree
        from .model.trainer import BagelTrainer

        trainer, error = None, None
        try:
            resolved = model_cfg.resolved(vocab_size=len(add_special_tokens(tokenizer)[0]),
                                          max_latent_size=cfg.data.packer.max_latent_size)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            trainer = BagelTrainer(resolved, pg_collection, device)
        except (ConfigError, ValueError) as exc:
            error = exc
        agree(error, "while building the model")
        clock.mark("model")
    summary = run_job(cfg, pg_collection, tokenizer, data, trainer=trainer, startup=clock)
    if rank == 0:  # the world's numbers; rank 0's own pipeline counters only in the debug log
        logger.info("summary: %s", json.dumps({k: v for k, v in summary.items() if k != "pipeline"}, default=str))
    return 0


def _configure(args: argparse.Namespace, overrides: list[str], rank: int) -> tuple[Any, Any, Any, Any]:
    """The launch's one validation pass, before Megatron-Core or Megatron-Bridge is imported (seconds, not the
    heavy imports' tens of seconds): the config's keys (typos), the model section, the recipe, the files the config
    names (by key and the file that set it), the parallel layout for ``WORLD_SIZE`` and the data checks
    (``validate_job``), every problem in one ``ConfigError``. Returns ``(JobConfig, model config, the recipe's
    ConfigContainer or None, ValidatedData or None)``: the data None with ``demo_data``, whose files exist only
    once rank 0 generated them (validated then)."""
    from .data.config import ConfigError
    from .data.job.config import load_job_config, validate_job

    cfg = load_job_config(args.config, overrides, defer_key_problems=True)
    model_cfg = None
    try:
        model_cfg = model_config(cfg.model, f"{args.config}: model")
    except ConfigError as exc:
        cfg.__dict__["_key_problems"] += exc.problems
    container = None
    if args.recipe and model_cfg is not None:
        container = _load_symbol(args.recipe)()
        changed = reconcile_recipe(container, cfg.train, _explicit_train_keys(overrides),
                                   has_valid=cfg.data.valid is not None)
        if changed and rank == 0:
            logger.info("--recipe: train.%s taken from the recipe (the config file's values are not used)",
                        ", train.".join(changed))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.demo_data:  # the data's files come later; keys, model and layout now
        found = [*cfg.__dict__["_key_problems"], *cfg.train.problems()]
        found += [] if cfg.train.problems() else _layout_problem(cfg.train, world_size)
        if found:
            raise ConfigError.of(found, header=f"{args.config}: {len(found)} problem(s) in this launch")
        return cfg, model_cfg, container, None
    return cfg, model_cfg, container, validate_job(cfg, world_size=world_size)


def _layout_problem(train: Any, world_size: int) -> list[str]:
    from .data.config import ConfigError

    try:
        train.parallel_layout(world_size)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _end_process(code: int) -> NoReturn:
    """End the rank's process with ``code`` now: run what an orderly exit runs (the threading module's exit hooks,
    which stop ``concurrent.futures`` pools; the ``atexit`` handlers: Energon workers, the prefetch producer,
    the watchdog's report directories, ``logging.shutdown``), flush stdout / stderr, then ``os._exit``.

    The interpreter's own finalization is skipped on purpose. Two things happen there that a training job does not
    want: the final garbage collections over the heap torch / Megatron-Core / Megatron-Bridge / transformers leave
    (~4.5 s of CPU per rank measured, every run and restart, against ~0.6 s), and the forced end of daemon threads
    still inside C++ code (torch's, gloo's): such a thread unwinds through a ``noexcept`` frame and the process
    aborts with "terminate called without an active exception" (SIGABRT) after a job that succeeded (seen once in
    three CI runs on a rank of a 2-rank torchrun job) -- torchrun then reports the whole job failed.
    """
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what finalization runs first: joins non-daemon threads
    if callable(shutdown):
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
