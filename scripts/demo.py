#!/usr/bin/env python3
"""The headline demo: train on the embedded demo data with 2 ranks, crash mid-run, restart, prove exact resume.

1. generate the demo dataset (official raw formats -> Energon) into demo_data/ if missing;
2. run A: an uninterrupted 2-rank torchrun job training the tiny reference model (``--model``; ``none`` for the
   data pipeline alone), recording a digest of every batch and the loss of every step on every rank;
3. run B: the same job with checkpoints, hard-killed (``os._exit``, no final save) after step ``--crash-after``;
4. run C: restart B from its last checkpoint (loader state through Bridge's ``maybe_load_dataloader_state``,
   model and optimizer from the trainer's state) to the end;
5. compare every (rank, step, micro-batch) digest and step loss of B+C with A, and the final parameters, and
   print the verdict. The loss lines of each run are printed as they were logged (one per log interval).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, args: list[str], log: Path) -> int:
    # --log-dir: torchrun's per-launch directory goes next to our log, not into the temp dir (one left per launch)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port",
           os.environ.get("BAGEL_DEMO_PORT", "29531"), "--log-dir", str(log.parent / "torchelastic"),
           str(REPO / "scripts" / "pretrain_bagel.py"), *args]
    print(f"$ torchrun --nproc-per-node={nproc} scripts/pretrain_bagel.py {' '.join(args)}", flush=True)
    t0 = time.time()
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    print(f"  -> exit code {rc} in {time.time() - t0:.0f}s (log: {log})", flush=True)
    return rc


def read_digests(path: Path) -> dict[tuple[int, int, int], tuple[str, str | None]]:
    """(rank, step, micro) -> (batch digest, the step's loss as float.hex or None in a data-only run)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[(r["rank"], r["step"], r["micro"])] = (r["digest"], r.get("loss"))
    return out


def print_loss_lines(log: Path, note: str = "") -> None:
    """The run's per-interval loss lines, as the job logged them (then ``note``, when there were any)."""
    lines = [line.split(": ", 1)[-1] for line in log.read_text().splitlines() if "| loss " in line]
    for line in lines:
        print("   ", line, flush=True)
    if lines and note:
        print("   ", note, flush=True)


#: The drop reasons of video records (``energon.cooking.common.DROP_REASONS``)
VIDEO_DROPS = ("missing_video", "video_decode_error", "video_tag_missing", "no_frame_sampler")


def print_video_line(log: Path) -> None:
    """Video in the mix: how many video records the demo's vlm_sft dataset holds (its manifest) and how many of
    the records run A read were dropped for a video reason (the job's summary line; 0 = every one was cooked)."""
    sys.path.insert(0, str(REPO))
    from bridge.models.bagel.data.energon.cooking.video import video_lines_of

    lines, files = video_lines_of(str(REPO / "demo_data" / "energon" / "vlm_sft" / "demo_vlm"))
    summary = [x.split("summary: ", 1)[1] for x in log.read_text().splitlines() if "summary: " in x]
    drops = json.loads(summary[-1]).get("drops", {}) if summary else {}
    dropped = {k: v for k, v in drops.items() if k in VIDEO_DROPS}
    print(f"    video in the mix: vlm_sft holds {lines} video records ({files} mp4 files, {lines - files} frame "
          f"folders), cooked as the official reader does (frame_sampler_args); dropped for a video reason in run A: "
          f"{sum(dropped.values())}{f' {dropped}' if dropped else ''}", flush=True)


def same_final_model(ckpt_a: Path, ckpt_b: Path, step: int) -> bool | None:
    """Whether both runs ended with the same parameters (every tensor, bit for bit); None without a model."""
    import torch

    files = [p / f"iter_{step:07d}" / "trainer.pt" for p in (ckpt_a, ckpt_b)]
    if not all(f.exists() for f in files):
        return None
    a, b = (torch.load(f, map_location="cpu", weights_only=True)["model"] for f in files)
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-interval", type=int, default=3)
    ap.add_argument("--crash-after", type=int, default=5)
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--model", default="bagel-tiny", help="model.name to train (default %(default)s; none: data only)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    if not 0 < args.save_interval <= args.crash_after < args.steps:
        raise SystemExit("error: need 0 < --save-interval <= --crash-after < --steps")
    out = REPO / args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = [f"train.train_iters={args.steps}", f"train.global_batch_size={args.nproc}",
              f"model.name={'null' if args.model in ('none', 'null') else args.model}", *args.overrides]

    print("== run A: uninterrupted reference", flush=True)
    if torchrun(args.nproc, [*common, f"train.save={out}/ckpt_a", f"--digest-log={out}/a.jsonl"], out / "a.log"):
        print((out / "a.log").read_text()[-3000:])
        return 1
    print_loss_lines(out / "a.log")
    print_video_line(out / "a.log")
    print(f"== run B: same job, checkpoint every {args.save_interval} steps, crash after step {args.crash_after}",
          flush=True)
    rc = torchrun(args.nproc, [*common, f"train.save={out}/ckpt_b", f"train.save_interval={args.save_interval}",
                               f"train.exit_after_step={args.crash_after}", f"--digest-log={out}/b.jsonl"],
                  out / "b.log")
    if rc == 0:
        print("error: run B was expected to crash")
        return 1
    resume_step = int((out / "ckpt_b" / "latest_checkpointed_iteration.txt").read_text())
    print(f"== run C: restart from the step-{resume_step} checkpoint", flush=True)
    if torchrun(args.nproc, [*common, f"train.save={out}/ckpt_b", f"train.load={out}/ckpt_b",
                             f"train.save_interval={args.save_interval}", f"--digest-log={out}/c.jsonl"],
                out / "c.log"):
        print((out / "c.log").read_text()[-3000:])
        return 1
    print_loss_lines(out / "c.log", f"(a line's loss is the mean over the steps since the previous line: the restart's "
                                    f"first line covers steps from {resume_step + 1} only, the verdict compares every "
                                    "step's loss)")

    a, b, c = read_digests(out / "a.jsonl"), read_digests(out / "b.jsonl"), read_digests(out / "c.jsonl")
    resumed = {**{k: v for k, v in b.items() if k[1] <= resume_step}, **c}
    mismatches = [k for k in sorted(a) if resumed.get(k) != a[k]]
    extra = sorted(set(resumed) - set(a))
    replayed_ok = all(b[k] == a[k] for k in b)
    print(f"\nreference batches: {len(a)}; crashed run: {len(b)} (steps 1-{args.crash_after}); "
          f"restarted run: {len(c)} (steps {resume_step + 1}-{args.steps}, {args.nproc} ranks)")
    model = same_final_model(out / "ckpt_a", out / "ckpt_b", args.steps)
    trained = model is not None
    if not mismatches and not extra and replayed_ok and len(c) > 0 and model is not False:
        what = "batch, step loss and the final model" if trained else "batch"
        print(f"resume verdict: identical — every {what} after the restart equals the uninterrupted run, bit for bit")
        return 0
    first = mismatches[0] if mismatches else (extra[0] if extra else None)
    print(f"resume verdict: DIFFERENT — {len(mismatches)} mismatching (batch or loss), {len(extra)} unexpected; "
          f"first at (rank, step, micro) = {first}" + ("; the final models differ" if model is False else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
