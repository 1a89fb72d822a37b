#!/usr/bin/env python3
"""Train-loop launcher for BAGEL data on Megatron: ``torchrun --nproc-per-node=N scripts/pretrain_bagel.py``.

CPU (default): gloo + Megatron-Core process groups (TP=PP=CP=1, DP = world size); every step pulls the
micro-batches Megatron would pull through Bridge's external-loader path, validates and accounts for them,
checkpoints loader state with Bridge's functions and resumes from ``train.load``.

GPU (``--recipe MODULE:FUNCTION --forward-step MODULE:NAME``): NCCL; the recipe returns a Megatron-Bridge
``ConfigContainer`` for your BAGEL model; this script sets ``cfg.dataset`` to our provider (loader built from
the same YAML) and calls Bridge's ``pretrain()``; Bridge then saves/restores the loader state itself.

Config: ``--config configs/demo.yaml`` (default) plus ``key=value`` overrides, e.g. ``train.train_iters=20
data.packer.use_flex=false train.load=runs/demo/ckpt``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

logger = logging.getLogger("pretrain_bagel")


def _load_symbol(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"error: expected MODULE:NAME, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def _init_distributed(train):
    import torch
    import torch.distributed as dist

    from bridge.models.bagel.data.job.topology import init_model_parallel

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # plain `python pretrain_bagel.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group(backend=backend)
    return init_model_parallel(train)


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


def _prepare_demo_data(cfg) -> None:
    import torch.distributed as dist

    from bridge.models.bagel.data.converter.demo import make_demo_data

    if dist.get_rank() == 0:
        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    dist.barrier()


def _run_bridge_pretrain(cfg, pg_collection, tokenizer, recipe: str, forward_step: str, data=None) -> None:
    """Thin GPU path: the user's recipe + our provider into Megatron-Bridge's own ``pretrain()``."""
    from megatron.bridge.training.pretrain import pretrain

    from bridge.models.bagel.data.job.runner import build_iterator

    _, loader = build_iterator(cfg, pg_collection, tokenizer, data)
    from bridge.models.bagel.data.external import BagelMegatronMIMODatasetProvider

    container = _load_symbol(recipe)()
    container.dataset = BagelMegatronMIMODatasetProvider(train_loader=loader)
    container.train.train_iters = cfg.train.train_iters
    container.train.global_batch_size = cfg.train.global_batch_size
    container.train.micro_batch_size = cfg.train.micro_batch_size
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "virtual_pipeline_model_parallel_size"):  # Bridge rebuilds its groups from the model config
        setattr(container.model, key, getattr(cfg.train, key))
    container.validation.eval_iters = 0
    container.validation.eval_interval = None
    if cfg.train.save:
        container.checkpoint.save = cfg.train.save
    if cfg.train.load:
        container.checkpoint.load = cfg.train.load
    pretrain(config=container, forward_step_func=_load_symbol(forward_step))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"),
                    help="job YAML: data.* + train.* (relative paths in it are relative to the file; default: "
                         "%(default)s)")
    ap.add_argument("--digest-log", help="append one sha256 per batch per rank to this JSONL file")
    ap.add_argument("--recipe", help="GPU: MODULE:FUNCTION returning a Megatron-Bridge ConfigContainer")
    ap.add_argument("--forward-step", help="GPU: MODULE:NAME of the forward step for Bridge's pretrain()")
    ap.add_argument("--debug", action="store_true", help="show full tracebacks")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (OmegaConf dotlist)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron", "torch", "bridge.models.bagel.data._bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # torch's C++-extension helper warns "No CUDA runtime is found" on every CPU process at import: nothing the
    # data job uses or the user can act on (a GPU machine has the runtime).
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    try:
        from bridge.models.bagel.data.job.config import load_job_config, validate_job
        from bridge.models.bagel.data.job.runner import run_job
        from bridge.models.bagel.data.tokenizer import load_tokenizer

        overrides = list(args.overrides) + ([f"train.digest_log={args.digest_log}"] if args.digest_log else [])
        cfg = load_job_config(args.config, overrides)
        # The one validation pass, every problem at once, before any process group exists (demo data: after
        # rank 0 generated it).
        data = None if cfg.demo_data else validate_job(cfg)
        pg_collection = _init_distributed(cfg.train)
        if cfg.demo_data:
            _prepare_demo_data(cfg)
            data = validate_job(cfg)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        if args.recipe:
            _run_bridge_pretrain(cfg, pg_collection, tokenizer, args.recipe, args.forward_step or "", data)
            return 0
        summary = run_job(cfg, pg_collection, tokenizer, data)
        if rank == 0:
            logger.info("summary: %s", json.dumps(summary, default=str))
        return 0
    except Exception as exc:  # one clear line per failing rank; --debug for the traceback
        if args.debug:
            raise
        from bridge.models.bagel.data.errors import error_lines

        # A first line of at most 300 characters, the detail on the following lines; one write for all of them:
        # ranks share torchrun's stderr pipe, and print() writes the newline separately.
        lines = error_lines(rank, getattr(exc, "kind", type(exc).__name__), str(exc))
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        _exit_together_if_all_ranks_failed(exc)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _skip_final_collections() -> None:
    """Let the interpreter shut down without its final garbage collections over the heap that torch,
    Megatron-Core, Megatron-Bridge and transformers leave (measured here: ~4.5 s of CPU per rank, every run
    and restart, against ~0.6 s). Only the cycle collector is skipped: ``atexit`` handlers (Energon workers,
    the prefetch producer, the watchdog's report dirs), module finalizers and everything ``main`` closed
    explicitly still run; objects freed by reference counting still are."""
    import gc

    gc.disable()
    gc.freeze()


if __name__ == "__main__":
    code = main()
    _skip_final_collections()
    sys.exit(code)
