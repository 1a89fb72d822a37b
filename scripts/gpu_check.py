#!/usr/bin/env python3
"""GPU check of attention from flex metadata: demo loader -> to_device -> BlockMask on the GPU -> FlexAttention.

1. Generates the embedded demo dataset into a temp dir (or uses ``--data``) and builds the real loader
   (Energon readers -> official packer -> RNG iterator) in flex mode at the BAGEL default budgets
   (32768 expected / 36864 max tokens).
2. Per batch: moves it to CUDA with ``attention.to_device`` (pinned, non-blocking), builds the ``BlockMask``
   on the GPU from ``sample_lens`` / ``split_lens`` / ``attn_modes`` (checked equal to torch's eager
   ``create_block_mask`` on the first batch), and runs compiled FlexAttention with random q/k/v at BAGEL-7B
   sizes (Qwen2-7B: 28 query heads, 4 KV heads, head_dim 128, bf16) over the whole padded sequence.
   Prints host->device copy ms, mask build ms and attention ms per 32K batch (CUDA-synchronised wall time).
3. Correctness on a small pack (5120 tokens): the mask materialised on the GPU equals the block-diagonal of
   the dense-mode masks of the same pack (same seed), the BlockMask tiles match it, and FlexAttention equals
   SDPA with the dense bool mask (bf16 both; also reported against a float32 SDPA reference).
4. Training through Megatron-Bridge: the tiny reference model (``bridge.models.bagel.model``) trained ``--train-steps``
   steps by Bridge's own ``pretrain()`` with this package's recipe (``bagel_recipe``: ``BagelModelProvider``,
   ``BagelDatasetProvider`` over the demo data, NullTokenizer, constant-LR Adam, no validation) and forward step
   (``step.forward_step``, wrapped to record each micro-batch's loss): every loss finite, and step 1's batch,
   evaluated again at the last step, has a lower loss than at step 1 (every step reads a new pack).
Last line: ``gpu_check: copy_ms=<x> mask_ms=<y> attn_ms=<z> train_steps=<n> loss_first=<a> loss_last=<b>
ok=<true|false>`` (means over 32K batches; step 4's loss of step 1's batch before training and at the last step).
Exit codes: 0 all checks passed, 1 a check failed, 77 CUDA absent (nothing checked; ``--dry-run`` runs the
same steps on the CPU at small sizes, as a smoke test of everything but the GPU: step 4 then builds the same
recipe, validates it, and trains its provider's model on its dataset provider's loader with the same forward step
and ``torch.optim.Adam``, in one gloo process; Bridge's ``pretrain()`` itself needs CUDA and is not called).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.models.bagel.data.attention import (  # noqa: E402
    block_diagonal_mask,
    block_mask,
    dense_mask,
    flex_metadata,
    to_device,
)

SKIP = 77


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="demo data dir (generated into a temp dir if omitted)")
    ap.add_argument("--batches", type=int, default=5, help="32K batches timed (default 5)")
    ap.add_argument("--expected", type=int, default=32768, help="expected_num_tokens (default 32768)")
    ap.add_argument("--max", type=int, default=36864, help="max_num_tokens = padded length (default 36864)")
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-steps", type=int, default=5,
                    help="optimizer steps of the training check, at least 2 (default 5)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke path: 1 batch at 7168/8192 tokens, 2/1 heads of 16, eager FlexAttention, "
                         "no create_block_mask comparison")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.batches, args.expected, args.max = 1, 7168, 8192
        args.heads, args.kv_heads, args.head_dim = 2, 1, 16
        args.train_steps = min(args.train_steps, 3)
    if args.train_steps < 2:
        ap.error("--train-steps must be at least 2 (the check compares step 1's batch before and after training)")
    return args


def data_config(data: Path, *, use_flex: bool, expected: int, max_tokens: int, seed: int):
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig

    return BagelDataConfig(groups=str(data / "groups.yaml"), dataset_info=str(data / "dataset_info.yaml"),
                           num_workers=0, seed=seed,
                           packer=PackerConfig(expected_num_tokens=expected, max_num_tokens=max_tokens,
                                               max_num_tokens_per_sample=min(16384, max_tokens // 2),
                                               prefer_buffer_before=min(16384, expected // 2), use_flex=use_flex,
                                               max_latent_size=64))  # the demo transforms reach 1024 px / 16


def loader(data: Path, tok, *, use_flex: bool, expected: int, max_tokens: int, seed: int, length: int):
    from bridge.models.bagel.data.build import build_bagel_train_loader

    cfg = data_config(data, use_flex=use_flex, expected=expected, max_tokens=max_tokens, seed=seed)
    return build_bagel_train_loader(cfg, tok, (0, 1), length=length)


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "Timer":
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.ms = 1e3 * (time.perf_counter() - self.t0)


def qkv(args, L: int, device: torch.device, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, args.heads, L, args.head_dim), (1, args.kv_heads, L, args.head_dim)
    return (torch.randn(shape[0], generator=g, device=device, dtype=dtype),
            torch.randn(shape[1], generator=g, device=device, dtype=dtype),
            torch.randn(shape[1], generator=g, device=device, dtype=dtype))


def same_block_mask(a, b) -> bool:
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)


def run(args: argparse.Namespace, data: Path) -> int:
    from torch.nn.attention.flex_attention import flex_attention

    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    flex = flex_attention if args.dry_run else torch.compile(flex_attention, dynamic=False)
    tok = build_qwen2_tokenizer()
    ok = True
    rows = []
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}; q/k/v {args.heads}/{args.kv_heads} heads x {args.head_dim}, {dtype}", flush=True)
    with loader(data, tok, use_flex=True, expected=args.expected, max_tokens=args.max, seed=args.seed,
                length=args.batches) as batches:
        for k in range(args.batches):
            batch = next(batches)
            L = sum(batch["sample_lens"])
            nbytes = sum(t.numel() * t.element_size() for t in batch.values() if isinstance(t, torch.Tensor))
            with Timer(device) as copy:
                on_dev = to_device(batch, device)
            with Timer(device) as mask:
                bm = block_mask(flex_metadata(on_dev, device))
            if k == 0 and not args.dry_run:  # (on the CPU this equality is a unit test; eager L² is slow there)
                with Timer(device) as ref_t:
                    ref = block_mask(flex_metadata(on_dev, device), method="create_block_mask")
                equal = same_block_mask(bm, ref)
                ok &= equal
                print(f"  BlockMask (intervals) == create_block_mask (eager, {ref_t.ms:.1f} ms): {equal}", flush=True)
                del ref
            q, kk, v = qkv(args, L, device, dtype, seed=k)
            with Timer(device) as first:  # compiles on the first batch, may recompile for a new mask_mod
                if not args.dry_run:
                    flex(q, kk, v, block_mask=bm, enable_gqa=True)
            with Timer(device) as attn:
                out = flex(q, kk, v, block_mask=bm, enable_gqa=True)
            ok &= bool(torch.isfinite(out).all())
            rows.append((copy.ms, mask.ms, attn.ms))
            print(f"batch {k}: L={L} real={batch['sequence_length']} samples={len(batch['sample_lens']) - 1} "
                  f"sparsity {bm.sparsity():.1f}% | host->device {copy.ms:7.2f} ms ({nbytes / 2**20:.1f} MiB) | "
                  f"mask {mask.ms:7.2f} ms | attention {attn.ms:8.2f} ms (first call {first.ms:.0f} ms)", flush=True)
            del q, kk, v, out
    ok &= small_pack_check(args, data, tok, device, dtype, flex)
    losses, after = train_check(args, data, tok)
    first, last = (losses[0] if losses else float("nan")), after
    trained = (len(losses) == args.train_steps and all(math.isfinite(x) for x in [*losses, last])
               and last < first)
    print(f"training check: {len(losses)} steps, losses {[round(x, 4) for x in losses]}; step 1's batch: loss "
          f"{first:.4f} before training, {last:.4f} after {args.train_steps - 1} updates; ok={trained}", flush=True)
    ok &= trained
    copy_ms, mask_ms, attn_ms = (statistics.fmean(r[i] for r in rows) for i in range(3))
    print(f"gpu_check: copy_ms={copy_ms:.2f} mask_ms={mask_ms:.2f} attn_ms={attn_ms:.2f} train_steps={len(losses)} "
          f"loss_first={first:.4f} loss_last={last:.4f} ok={str(ok).lower()}")
    return 0 if ok else 1


def train_check(args: argparse.Namespace, data: Path, tok) -> tuple[list[float], float]:
    """Step 4: the reference model trained through Bridge's ``pretrain()`` (``--dry-run``: the same recipe and
    forward step in a CPU loop); ``(the loss of every optimizer step, step 1's batch's loss at the last step)``.

    Every step reads a new pack, so the step losses alone do not show learning (the packs differ in their mix of
    text and images); the recorded forward step therefore keeps a copy of step 1's batch and, at the last step,
    evaluates it (no gradient) with the model after ``train_steps - 1`` updates: that loss must be below step 1's.
    NaN when the check did not get that far."""
    from bridge.models.bagel.model.config import BagelModelConfig
    from bridge.models.bagel.model.provider import bagel_recipe
    from bridge.models.bagel.model.step import forward_step

    data_cfg = data_config(data, use_flex=True, expected=args.expected, max_tokens=args.max, seed=args.seed)
    model_cfg = BagelModelConfig(name="bagel-tiny")
    model_cfg.optimizer.lr = 1e-2
    container = bagel_recipe(data_cfg, model_cfg, tokenizer=tok, train_iters=args.train_steps, global_batch_size=1)
    micro_losses: list[float] = []
    held: dict[str, Any] = {}  # step 1's batch (a copy: the loader may reuse its memory) and its loss at the end

    def recording_forward_step(data_iterator, model):
        if "batch" not in held:
            batch = next(data_iterator)
            held["batch"] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                             for k, v in batch.items()}
            data_iterator = iter([batch])
        elif len(micro_losses) == args.train_steps - 1:  # the last step: the model after train_steps - 1 updates
            with torch.no_grad():
                out, fn = forward_step(iter([held["batch"]]), model)
                held["loss_after"] = float(fn(out)[1]["loss"])
        output, loss_fn = forward_step(data_iterator, model)

        def recording_loss(output_tensor):
            loss, report = loss_fn(output_tensor)
            micro_losses.append(float(report["loss"]))
            return loss, report

        return output, recording_loss

    if args.dry_run:
        dry_run_training(container, recording_forward_step, micro_losses, args.train_steps)
        return micro_losses, held.get("loss_after", float("nan"))
    from bridge.models.bagel.data._bridge import import_bridge_training

    api = import_bridge_training()
    if api.pretrain is None:
        print(f"training check: {api.error}", flush=True)
        return [], float("nan")
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29533")
    api.pretrain(config=container, forward_step_func=recording_forward_step)
    return micro_losses, held.get("loss_after", float("nan"))  # one micro-batch per step at global batch 1, DP 1


def dry_run_training(container, forward_step_func, micro_losses: list[float], steps: int) -> list[float]:
    """CPU: what ``pretrain()`` would do with ``container``, minus Megatron's CUDA-only schedule and optimizer."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import RerunDataIterator

    from bridge.models.bagel.data._bridge import import_bridge

    container.validate()
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp(prefix='gpu_check_')}/store", rank=0,
                                world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        provider = container.model
        provider.use_cpu_initialization = True
        torch.manual_seed(container.rng.seed)
        model = provider.provide()
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp", "dp"])
        context = import_bridge().DatasetBuildContext(train_samples=steps, valid_samples=0, test_samples=0,
                                                      pg_collection=pgs)
        train, _, _ = container.dataset.build_datasets(context)
        o = container.optimizer
        optimizer = torch.optim.Adam(model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                     weight_decay=o.weight_decay)
        iterator = RerunDataIterator(train)
        with train:
            for _ in range(steps):
                optimizer.zero_grad()
                output, loss_fn = forward_step_func(iterator, model)
                loss, _ = loss_fn(output)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
                optimizer.step()
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()
    return micro_losses


def small_pack_check(args, data: Path, tok, device: torch.device, dtype: torch.dtype, flex) -> bool:
    """Flex vs dense on one small pack: masks exact, FlexAttention == SDPA within bf16 tolerance."""
    kw = dict(expected=4096, max_tokens=5120, seed=args.seed, length=1)
    with loader(data, tok, use_flex=True, **kw) as f_it, loader(data, tok, use_flex=False, **kw) as d_it:
        fb, db = to_device(next(f_it), device), to_device(next(d_it), device)
    ours = dense_mask(fb, device)
    official = block_diagonal_mask(db["nested_attention_masks"], fb["sample_lens"][-1])
    masks_equal = ours.shape == official.shape and torch.equal(ours, official)
    bm = block_mask(fb, device)
    q, k, v = qkv(args, ours.shape[0], device, dtype, seed=1234)
    out = flex(q, k, v, block_mask=bm, enable_gqa=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ours, enable_gqa=True)
    ref32 = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=ours,
                                                             enable_gqa=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    close = torch.allclose(out.float(), sdpa.float(), atol=tol, rtol=tol)
    print(f"small pack L={ours.shape[0]}: mask == block-diagonal of the dense-mode masks: {masks_equal}; "
          f"flex vs SDPA max|diff| {(out.float() - sdpa.float()).abs().max().item():.2e} (tol {tol}), "
          f"vs float32 SDPA: flex {(out.float() - ref32).abs().max().item():.2e}, "
          f"SDPA {(sdpa.float() - ref32).abs().max().item():.2e}; ok={masks_equal and close}", flush=True)
    return masks_equal and close


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing was checked "
              "(run on a GPU machine, or pass --dry-run for the CPU smoke path)", file=sys.stderr)
        return SKIP
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    with contextlib.ExitStack() as stack:
        data = Path(args.data) if args.data else Path(stack.enter_context(tempfile.TemporaryDirectory())) / "demo"
        if not (data / "groups.yaml").exists():
            from bridge.models.bagel.data.converter.demo import make_demo_data

            t0 = time.perf_counter()
            make_demo_data(str(data))
            print(f"demo data generated in {time.perf_counter() - t0:.1f} s at {data}", flush=True)
        return run(args, data)


if __name__ == "__main__":
    sys.exit(main())
