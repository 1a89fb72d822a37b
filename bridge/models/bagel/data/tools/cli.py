"""``bagel-data``: convert official BAGEL raw data to Energon crude WebDatasets, verify them (``verify``), check
budgets (``stats``), look at packed batches (``inspect``), rewrite loader state for another DP size
(``resize-state``), check a run's exactly-once ledger (``ledger``), or generate the demo dataset."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..converter.convert import (DEFAULT_MAX_IMAGE_PIXELS, ConvertError, ConvertSummary, convert_from_config,
                                 convert_group, merge_all)
from ..energon.layout import DEFAULT_SAMPLES_PER_SHARD, EDIT, T2I, VLM
from . import text_table

logger = logging.getLogger(__name__)


def format_summary(summaries: Sequence[ConvertSummary]) -> str:
    """A plain-text table: one line per converted dataset plus a total line (parts: a status line each)."""
    head = ("dataset", "samples", "shards", "bytes", "warnings", "skipped (by reason)", "bad images (by reason)")

    def row(label: str, ss: Sequence[ConvertSummary]) -> tuple[str, ...]:
        skipped, bad = Counter(), Counter()
        for s in ss:
            skipped.update(s.skipped)
            bad.update(s.bad_images)
        counts = [sum(getattr(s, k) for s in ss) for k in ("samples", "shards", "bytes")]
        return (label, *map(str, counts), str(sum(max(s.num_warnings, len(s.warnings)) for s in ss)),
                *(", ".join(f"{r}: {n}" for r, n in sorted(c.items())) or "-" for c in (skipped, bad)))

    rows = [row(f"{s.group}/{s.dataset_name}", [s]) for s in summaries] + [row("TOTAL", summaries)]
    lines = text_table(head, rows, left=(0, 5, 6))
    lines += [f"{s.group}/{s.dataset_name}: {s.status}" for s in summaries if s.status != "published"]
    return "\n".join(lines)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (argparse's ``(default: …)``), unless the help names it already or
    there is none to name (a required flag, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _add(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand that also takes ``-v/--verbose`` after its name (``bagel-data convert t2i ... -v``)."""
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    return sub.add_parser(name, parents=[verbose], formatter_class=_HelpFormatter, **kw)


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``low`` (argparse's own one-line usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _convert_common(sp: argparse.ArgumentParser, named: bool = True) -> None:
    """The flags every ``bagel-data convert`` format takes (``named``: also ``--name`` / ``--source-root``)."""
    sp.add_argument("--out", required=True, help="output root; datasets go to OUT/<group>/<name>/")
    if named:
        sp.add_argument("--name", help="dataset name (default: data dir basename / jsonl stem)")
        sp.add_argument("--source-root", help="root that stored paths are relative to (default: the parent of "
                        "--data-dir; vlm: the parent of the folder holding both --jsonl and --image-dir)")
    sp.add_argument("--samples-per-shard", type=_at_least(1), default=DEFAULT_SAMPLES_PER_SHARD,
                    help="samples per Energon tar shard")
    sp.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar (logs, array jobs)")
    sp.add_argument("--workers", type=_at_least(1), default=1, help="processes converting source files (default 1)")
    sp.add_argument("--part", type=_at_least(0), help="convert only part PART of --num-parts (0-based; required "
                    "with --num-parts > 1)")
    sp.add_argument("--num-parts", type=_at_least(1), default=1,
                    help="split the work units into this many disjoint parts (one per job of an array); "
                         "publish with `bagel-data convert merge --out OUT` once all are done")
    sp.add_argument("--max-image-pixels", type=_at_least(1), default=DEFAULT_MAX_IMAGE_PIXELS,
                    help=f"count stored images with more pixels (header check; default {DEFAULT_MAX_IMAGE_PIXELS},"
                         " PIL's MAX_IMAGE_PIXELS)")


def _add_convert_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``bagel-data convert {t2i,edit,vlm,config,merge}``: see ``converter.convert``."""
    conv = _add(sub, "convert", help="official raw format -> <out>/<group>/<name>/ crude WebDataset")
    csub = conv.add_subparsers(dest="fmt", required=True)

    t2i = _add(csub, "t2i", help="t2i_pretrain parquet folder")
    t2i.add_argument("--data-dir", required=True, help="the folder of the dataset's *.parquet files (columns image, "
                     "captions: docs/raw-formats.md)")
    _convert_common(t2i)
    edit = _add(csub, "edit", help="unified_edit parquet folder + parquet_info JSON")
    edit.add_argument("--data-dir", required=True, help="the folder of the dataset's *.parquet files (columns "
                      "image_list, instruction_list)")
    edit.add_argument("--parquet-info", required=True, help="the official parquet_info JSON {parquet path: "
                      "{num_row_groups: N}}")
    edit.add_argument("--parquet-info-root", help="directory that relative parquet_info keys are relative to")
    _convert_common(edit)
    vlm = _add(csub, "vlm", help="vlm_sft jsonl + image folder")
    vlm.add_argument("--jsonl", required=True, help="the JSONL file (image + conversations per line)")
    vlm.add_argument("--image-dir", required=True, help="the folder relative image paths are relative to (the "
                     "registry's data_dir)")
    _convert_common(vlm)
    cfg = _add(csub, "config", help="every sub-dataset a grouped YAML names, paths from dataset_info")
    cfg.add_argument("--dataset-info", required=True, help="YAML/JSON {group: {name: {data_dir, ...}}}")
    cfg.add_argument("--groups", required=True, help="grouped YAML (official example.yaml format)")
    cfg.add_argument("--source-root", help="directory relative dataset_info paths are relative to (default: cwd)")
    _convert_common(cfg, named=False)
    mrg = _add(csub, "merge", help="join the parts of a --num-parts conversion under OUT and publish them")
    mrg.add_argument("--out", required=True, help="the --out of the part runs")
    mrg.add_argument("--overwrite", action="store_true", help="replace existing output datasets")


def _add_job_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The commands over a job YAML: ``bagel-data inspect`` (``inspection.run_inspect``, docs/inspect.md), ``stats``
    (``_stats``) and ``resize-state`` (``job.checkpoint.resize_checkpoint``)."""
    ins = _add(sub, "inspect", help="build the job's loader and report/draw N packed batches")
    ins.add_argument("--config", required=True, help="job YAML (the one scripts/pretrain_bagel.py runs)")
    ins.add_argument("--batches", type=int, default=4, help="packed batches to inspect (default 4)")
    ins.add_argument("--out", default="runs/inspect", help="folder for batch_NNNN.png (default runs/inspect)")
    ins.add_argument("--size", type=int, default=512, help="attention matrix side in pixels (default 512)")
    ins.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank whose stream to inspect")
    ins.add_argument("--dp-size", type=int, default=1, help="data-parallel size of the run")
    ins.add_argument("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)")
    ins.add_argument("overrides", nargs="*", help="key=value job config overrides (as for the job)")
    stats = _add(sub, "stats", help="token estimates per group/dataset and a budget advisor for a job config")
    stats.add_argument("--config", required=True, help="job YAML (configs/demo.yaml format)")
    stats.add_argument("overrides", nargs="*", help="key=value job config overrides")
    stats.add_argument("--max-samples", type=int, help="read only the first N samples of each dataset (default: all)")
    stats.add_argument("--histogram", default="bagel-data-stats.png", help="PNG to write ('' = none)")
    stats.add_argument("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)")
    rs = _add(sub, "resize-state", help="rewrite a checkpoint's loader state files for another DP size "
                        "(data.order: elastic), for Megatron-Bridge's pretrain(), which reads only its own rank's file")
    rs.add_argument("root", help="the checkpoint root (train.save / checkpoint.save: holds energon/iter_N/)")
    rs.add_argument("--dp-size", type=int, required=True, help="the DP size of the run that will resume")
    rs.add_argument("--config", required=True, help="the run's job YAML (its data section builds the loader whose "
                    "stages resize the state)")
    rs.add_argument("overrides", nargs="*", help="key=value job config overrides (as given to the run)")
    rs.add_argument("--step", type=int, help="the checkpoint step (default: latest_checkpointed_iteration.txt)")


def _add_run_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``bagel-data verify`` (``tools.verify``), ``ledger`` (``tools.ledger``) and ``demo-data`` (the small procedural
    demo dataset)."""
    ver = _add(sub, "verify", help="check every shard and sample of converted datasets against their manifests "
                                   "(exit 0 ok, 1 damaged, 2 error, 3 datasets without checksums)")
    ver.add_argument("targets", nargs="+", metavar="DATASET_OR_CONFIG",
                     help="a converted dataset dir, a dir holding them (the converter's --out), a dataset_info "
                          "registry with energon_path entries, or a job YAML")
    ver.add_argument("--workers", type=_at_least(1), default=1, help="processes checking shards (default 1)")
    ver.add_argument("--part", type=_at_least(0), help="check only part PART of --num-parts (0-based)")
    ver.add_argument("--num-parts", type=_at_least(1), default=1,
                     help="split the shards into this many disjoint parts (one per job of an array)")
    ver.add_argument("--no-progress", action="store_true", help="no progress bar (logs, array jobs)")
    ldg = _add(sub, "ledger", help="check that an elastic-order run read every sample exactly once (exit 0: yes, "
                         "1: no, 2: bad input)")
    ldg.add_argument("root", nargs="?", help="the checkpoint root of the run's last world (train.save: holds "
                     "energon/iter_N/), with --digests")
    ldg.add_argument("--run", metavar="ROOT", help="the checkpoint root of the run's last world: the packed reads "
                     "come from the ledger the job writes into every checkpoint (no digest logs needed)")
    ldg.add_argument("--digests", nargs="+", metavar="JSONL",
                     help="every digest log of the run (train.digest_log / --digest-log of each launch, all "
                          "restarts), in launch order (instead of --run)")
    ldg.add_argument("--step", type=int, help="the checkpoint step whose loader states end the run (default: "
                     "latest_checkpointed_iteration.txt); digest rows after it are left out")
    demo = _add(sub, "demo-data", help="generate the small procedural demo dataset (raw + converted)")
    demo.add_argument("out", help="output folder (raw/, energon/, groups.yaml, dataset_info.yaml)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the procedural scenes")
    demo.add_argument("--scale", choices=("small", "medium"), default="small", help="dataset size")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagel-data", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_convert_parser(sub)
    _add_job_parsers(sub)
    _add_run_parsers(sub)
    return p


def _data_errors() -> tuple[type[Exception], ...]:
    """The one-line errors of reading a converted dataset: a damaged or missing file (``DataReadError``, naming
    it and the remedy) and a read that did not return in ``data.timeout_s`` (``DataTimeoutError``)."""
    from ..errors import DataReadError
    from ..watchdog import DataTimeoutError

    return DataReadError, DataTimeoutError


def _run_inspect(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..config import ConfigError
    from .inspection import run_inspect

    try:  # a damaged dataset or a read that never returns: the reader's one line (DataReadError, DataTimeoutError)
        summaries = run_inspect(args.config, overrides=args.overrides, batches=args.batches, out=args.out,
                                size=args.size, dp_rank=args.dp_rank, dp_size=args.dp_size,
                                progress=not args.no_progress, emit=lambda text: tqdm.write(text, file=sys.stdout))
    except (ConfigError, ValueError, FileNotFoundError, *_data_errors()) as e:
        logger.error("%s", e)
        return 2
    print(f"{len(summaries)} batches inspected; pictures in {args.out}/")
    return 0


def _stats(args: argparse.Namespace) -> int:
    """``bagel-data stats``: print the report; exit 3 when the configured budgets can never yield a batch, 1 when
    it reports an ERROR (a budget problem the job refuses at start), 2 when the config cannot be read, else 0."""
    from .budget_stats import job_stats
    from ..config import ConfigError

    try:
        report = job_stats(args.config, args.overrides, max_samples=args.max_samples, progress=not args.no_progress,
                           histogram=args.histogram or None)
    except (ConfigError, *_data_errors()) as e:
        logger.error("%s", e)
        return 2
    print(report.format())
    return 3 if report.impossible else int(any(f.level == "error" for f in report.findings))


def _verify(args: argparse.Namespace) -> int:
    """``bagel-data verify``: print the report; exit 0 ok, 1 damaged, 2 could not run, 3 unverified datasets."""
    from tqdm import tqdm

    from .verify import EXIT_ERROR, VerifyError, format_report, verify

    bar = tqdm(total=0, unit="B", unit_scale=True, desc="verify", disable=args.no_progress or not sys.stderr.isatty())

    def progress(total: int, done: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        report = verify(args.targets, workers=args.workers, part=args.part or 0, num_parts=args.num_parts,
                        progress=progress)
    except VerifyError as e:
        logger.error("%s", e)
        return EXIT_ERROR
    finally:
        bar.close()
    print(format_report(report))
    return report.exit_code


def _ledger(args: argparse.Namespace) -> int:
    """``bagel-data ledger``: ``ledger.check_exactly_once`` over a run's digest logs and its last checkpoint's loader
    states; exit 0 when exactly once holds, 1 when it does not (problems printed), 2 for unusable input."""
    from ..config import ConfigError
    from ..job.checkpoint import read_loader_states, read_run_reads, read_step
    from .ledger import check_exactly_once, format_report, read_digest_reads

    root = args.run or args.root
    try:
        if (args.run is None) == (args.digests is None) or (args.run and args.root):
            raise ConfigError("ledger: give either --run ROOT (the job's own ledger) or ROOT --digests JSONL ...")
        step = args.step if args.step is not None else read_step(root)
        states = read_loader_states(root, step)
        if not states:
            raise ConfigError(f"{root}: no loader state files at step {step}")
        if args.run:
            reads, chain = read_run_reads(root, step)
            source = f"{len(chain)} checkpoints' packed-reads ledgers ({' <- '.join(chain)})"
        else:
            reads, source = read_digest_reads(args.digests, up_to_step=step), f"{len(args.digests)} digest logs"
        report = check_exactly_once(reads, states)
    except (ConfigError, ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    print(f"{root} step {step}: {len(states)} DP ranks, {source}")
    print(format_report(report))
    return 0 if report.ok else 1


def _resize_state(args: argparse.Namespace) -> int:
    """``bagel-data resize-state``: every new rank's loader state from all old ranks' (``job.checkpoint``)."""
    from ..build import build_bagel_train_loader
    from ..config import ConfigError
    from ..job.checkpoint import read_step, resize_checkpoint
    from ..job.config import load_job_config
    from ..state import StateError
    from ..tokenizer import load_tokenizer

    try:
        step = args.step if args.step is not None else read_step(args.root)

        def open_loader():
            cfg = load_job_config(args.config, args.overrides)
            return build_bagel_train_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), (0, args.dp_size))

        paths = resize_checkpoint(args.root, step, args.dp_size, open_loader)
    except (ConfigError, StateError, FileExistsError) as e:
        logger.error("%s", e)
        return 2
    if not paths:
        print(f"{args.root} step {step}: already {args.dp_size} loader state files, nothing to do")
    else:
        print(f"{args.root} step {step}: wrote {len(paths)} loader state files for DP {args.dp_size} "
              f"(old files kept in {os.path.dirname(paths[0])}/resized_from_dp*/)")
    return 0


@contextlib.contextmanager
def _quiet_logs(verbose: bool) -> Iterator[None]:
    """PIL's DEBUG hidden (a line or two per image header read, thousands with -v) and, unless ``verbose``,
    Megatron's import-time notes (no Transformer Engine / Apex on this machine, experimental classes): ~30 lines
    before resize-state's one line, nothing a data tool acts on. Logger levels and warning filters are restored
    after, for a caller that runs ``main`` in process."""
    levels = {"PIL": logging.INFO, **({} if verbose else {"megatron": logging.WARNING})}
    old = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    try:
        with warnings.catch_warnings():
            if not verbose:
                warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
            yield
    finally:
        for name, level in old.items():
            logging.getLogger(name).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # key=value overrides may follow options (`resize-state ROOT --dp-size 2 --config job.yaml data.x=1`), which
    # argparse alone refuses once an option separates them from the command's first positional
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "part", 0) is None and args.num_parts > 1:  # convert FMT / verify
        logger.error("--num-parts %d needs --part (0 .. %d): which part this run %s", args.num_parts,
                     args.num_parts - 1, "checks" if args.cmd == "verify" else "converts")
        return 2
    with _quiet_logs(args.verbose):
        try:
            return _COMMANDS.get(args.cmd, _convert)(args)
        except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
            if args.verbose:
                raise
            again = ("; run the same command again: the conversion resumes where it stopped"
                     if args.cmd == "convert" else "")
            logger.error("interrupted%s", again)
            return 130


def _convert(args: argparse.Namespace) -> int:
    """``bagel-data convert FMT`` and ``demo-data``: print the summary table; exit 2 on a ConvertError."""
    try:
        if args.cmd == "demo-data":
            from ..converter.demo import make_demo_data

            summaries = make_demo_data(args.out, seed=args.seed, scale=args.scale)
            if not summaries:
                print(f"demo data already complete in {args.out} (seed {args.seed}, scale {args.scale})")
                return 0
        elif args.fmt == "merge":
            summaries = merge_all(args.out, overwrite=args.overwrite)
        else:
            kw = dict(samples_per_shard=args.samples_per_shard, progress=not args.no_progress, overwrite=args.overwrite,
                      workers=args.workers, part=args.part or 0, num_parts=args.num_parts,
                      max_image_pixels=args.max_image_pixels)
            if args.fmt == "config":
                summaries = convert_from_config(args.dataset_info, args.groups, args.out, source_root=args.source_root,
                                                **kw)
            else:
                kw.update(dataset_name=args.name, source_root=args.source_root)
                if args.fmt == "t2i":
                    summaries = [convert_group(T2I, args.out, data_dir=args.data_dir, **kw)]
                elif args.fmt == "edit":
                    summaries = [convert_group(EDIT, args.out, data_dir=args.data_dir,
                                               parquet_info_path=args.parquet_info,
                                               parquet_info_root=args.parquet_info_root, **kw)]
                else:
                    summaries = [convert_group(VLM, args.out, jsonl_path=args.jsonl, image_dir=args.image_dir, **kw)]
    except ConvertError as e:
        logger.error("%s", e)
        return 2
    print(format_summary(summaries))
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": _run_inspect, "stats": _stats, "resize-state": _resize_state, "verify": _verify, "ledger": _ledger}


if __name__ == "__main__":
    sys.exit(main())
