"""``BagelTrainer``: the main job's trainer (the ``trainer`` of ``data.job.runner.run_job``) for ``BagelModel``.

One optimizer step per job step, on CPU (gloo) or one GPU per rank (and ``eval_step``: the same loss on the
validation batches, no gradients, no optimizer step):

1. every micro-batch of the step goes through ``step.forward_step`` (the function Bridge's ``pretrain()`` calls)
   and ``loss_func``; the loss divided by the number of micro-batches is back-propagated, so gradients
   accumulate over micro-batches as in Megatron-Core's schedules (gradient accumulation: global batch >
   DP size is supported);
2. a failure on any rank (a non-finite loss, a malformed pack) is agreed on before any collective
   (``data.job.topology.agree``), so every rank raises together instead of waiting in the reduction;
3. gradients are averaged over the data-parallel group **deterministically**: every rank all-gathers every
   rank's flat gradient and sums them in rank order (0, 1, …, W-1), then divides by W. Each rank computes the
   same bits, so replicas never drift and a restart at the same DP size reproduces the run bit for bit.
   Cost: W × the gradient size of memory per rank for the gather (a reference model's price; Megatron-Core's
   ``DistributedDataParallel`` on GPUs reduces in buckets instead, with NCCL's own summation order);
4. global-norm clipping and ``torch.optim.AdamW`` (constant learning rate, ``model.optimizer``).

Megatron-Core's optimizer and DDP wrappers (``get_megatron_optimizer``, ``DistributedDataParallel``) and its
schedules allocate on CUDA, so on CPU this trainer uses torch's; under Bridge's ``pretrain()`` they are Bridge's.
``state_dict`` / ``load_state_dict`` hold model + optimizer + the model's identity (a restart with another model
shape is refused, naming the keys); the loader state stays in Bridge's dataloader-state files.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..data.config import ConfigError
from ..data.job.topology import agree
from .config import BagelModelConfig
from .model import BagelModel, build_model
from .step import forward_step

__all__ = ["BagelTrainer", "ordered_mean"]

logger = logging.getLogger(__name__)


def ordered_mean(local: torch.Tensor, group: Any) -> torch.Tensor:
    """Mean of ``local`` over the ranks of ``group``, summed in rank order: the same bits on every rank and in
    every run (an all-reduce's summation order is the backend's). ``local``: any tensor, same shape and dtype on
    every rank; returns a new tensor."""
    world = dist.get_world_size(group)
    if world == 1:
        return local.clone()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    total = gathered[0].clone()
    for part in gathered[1:]:
        total += part
    return total / world


class BagelTrainer:
    """Trains ``BagelModel`` in the main job (module docstring). ``cfg``: the resolved ``BagelModelConfig``;
    ``pg_collection``: Megatron's groups (``dp`` reduces gradients; TP = PP = CP = 1 is required);
    ``device``: this rank's device. Every method is collective over the world unless said otherwise."""

    def __init__(self, cfg: BagelModelConfig, pg_collection: Any, device: torch.device | str = "cpu") -> None:
        sizes = {k: getattr(pg_collection, k).size() for k in ("tp", "pp", "cp")}
        if any(v != 1 for v in sizes.values()):
            raise ConfigError(f"model: the reference model runs with TP = PP = CP = 1 (data parallelism only), got "
                              f"{sizes}; set train.tensor/pipeline/context_model_parallel_size to 1 or model.name=null "
                              "for a data-only job")
        self.cfg, self.dp, self.device = cfg, pg_collection.dp, torch.device(device)
        self.model: BagelModel = build_model(cfg, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                           weight_decay=o.weight_decay, foreach=False)
        logger.info("model %s: %.2fM parameters (%d layers, hidden %d, %d heads / %d KV groups, vocab %d), attention "
                    "%s, AdamW lr %g, deterministic DP reduction over %d ranks", cfg.name,
                    sum(p.numel() for p in self.params) / 1e6, cfg.num_layers, cfg.hidden_size,
                    cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size, cfg.attention, o.lr, self.dp.size())

    def train_step(self, batches: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of job step ``step``.

        Returns the step's values averaged over micro-batches and DP ranks (identical on every rank): ``loss``,
        ``ce_loss``, ``mse_loss``, and ``grad_norm`` (global L2 norm before clipping). Raises ``AgreedError`` on
        every rank when any rank's forward/backward failed (its message names rank, step and micro-batch).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        reports = torch.zeros(3, dtype=torch.float64, device=self.device)  # on the device: NCCL gathers only CUDA
        error: BaseException | None = None
        try:
            for micro, batch in enumerate(batches):
                output, loss_fn = forward_step(iter([batch]), self.model)
                loss, report = loss_fn(output)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"rank {dist.get_rank()} step {step} micro-batch {micro}: loss is {loss.item()} (ce "
                        f"{report['ce loss'].item()}, mse {report['mse loss'].item()}); samples "
                        f"{[d.get('dataset_name') for d in batch.get('batch_data_indexes', [])]}")
                (loss / len(batches)).backward()
                reports += torch.stack([report[k].double() for k in ("loss", "ce loss", "mse loss")]) / len(batches)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        agree(error, f"in the training step {step}")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = ordered_mean(torch.cat([g.reshape(-1) for g in grads]), self.dp)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        clip = self.cfg.optimizer.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else math.inf, foreach=False)
        self.optimizer.step()
        loss, ce, mse = ordered_mean(reports, self.dp).tolist()
        return {"loss": loss, "ce_loss": ce, "mse_loss": mse, "grad_norm": float(norm)}

    def eval_step(self, batches: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
        """The loss over this rank's validation micro-batches of the evaluation after job step ``step``: the same
        forward step and loss as ``train_step``, in eval mode, without gradients or an optimizer step (the model and
        optimizer are untouched; the diffusion noise comes from each batch's identity, so an evaluation of the same
        model on the same batches gives the same bits).

        Returns ``loss``, ``ce_loss``, ``mse_loss`` averaged over micro-batches and DP ranks in rank order (identical
        on every rank). Raises ``AgreedError`` on every rank when any rank's forward failed or gave a non-finite loss.
        """
        self.model.eval()
        reports = torch.zeros(3, dtype=torch.float64, device=self.device)
        error: BaseException | None = None
        try:
            with torch.no_grad():
                for micro, batch in enumerate(batches):
                    output, loss_fn = forward_step(iter([batch]), self.model)
                    loss, report = loss_fn(output)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"rank {dist.get_rank()} evaluation at step {step} batch {micro}: "
                                                 f"loss is {loss.item()}")
                    reports += torch.stack([report[k].double() for k in ("loss", "ce loss", "mse loss")]) / max(
                        len(batches), 1)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        finally:
            self.model.train()
        agree(error, f"in the evaluation at step {step}")
        loss, ce, mse = ordered_mean(reports, self.dp).tolist()
        return {"loss": loss, "ce_loss": ce, "mse_loss": mse}

    def parameter_digest(self) -> str:
        """sha256 over every tensor of the model's state dict, in order (local; equal across ranks while the
        replicas agree)."""
        h = hashlib.sha256()
        for name, p in self.model.state_dict().items():
            if not isinstance(p, torch.Tensor):  # Megatron-Core layers' ``_extra_state`` (None)
                continue
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Model + optimizer + the model's identity (collective: first checks that every DP replica holds the
        same parameters, ``RuntimeError`` naming the ranks otherwise)."""
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, self.parameter_digest())
        if len(set(digests)) != 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in set(digests)}
            raise RuntimeError(f"model replicas diverged: ranks {list(groups.values())} hold different parameters; "
                               "the gradient reduction was not identical on every rank")
        return {"model_identity": self.cfg.identity(), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore model + optimizer; ``ConfigError`` naming every differing key when the checkpoint was written
        for another model shape (local: every rank loads the same file)."""
        saved = dict(state.get("model_identity", {}))
        mine = self.cfg.identity()
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if differ:
            raise ConfigError("train.load: the checkpoint's model differs from model.* of this run in "
                              + ", ".join(f"{k} ({saved.get(k)!r} -> {mine.get(k)!r})" for k in differ)
                              + "; restore with the same model settings")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
