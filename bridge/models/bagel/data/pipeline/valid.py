"""``BagelValidLoader``: the validation stream, the same packed batches at every evaluation.

Megatron consumes a validation iterator of an external loader (``dataloader_type="external"``) by pulling
``eval_iters × num_microbatches`` micro-batches per evaluation from the one object it was given (Bridge wraps it in
``RerunDataIterator`` once, at setup, and never resets it). This loader makes every evaluation see the same
batches without any state to save: it builds a fresh loader (``build()``: the training builder over the validation
groups, from the fixed ``data.seed`` and this rank's DP slice) for the first pull of an evaluation, serves
``batches_per_eval`` batches from it, then closes it, so the next pull starts the stream again from its beginning.

Its stream is therefore a function of the configuration only: a restart from a checkpoint, or another evaluation
of the same run, gives the same batches. A consumer that pulls another number of batches per evaluation breaks
the alignment: ``batches_per_eval`` must be what one evaluation pulls on this rank (the job:
``train.eval_iters × micro-batches per step``; Bridge: ``validation.eval_iters × eval_global_batch_size / DP``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["BagelValidLoader"]


class BagelValidLoader:
    """An iterator of packed batches restarting after every ``batches_per_eval`` batches (module docstring).

    ``build(first)``: returns a fresh loader of the validation stream (an iterator of packed batch dicts with
    ``close()``; ``first`` is True for the first build only, so it may log once). ``batches_per_eval``: batches one
    evaluation pulls on this rank (> 0). ``seq_length``: the packed sequence length (tokens; the packer's
    ``max_num_tokens``), read by the providers. ``len()`` is ``batches_per_eval`` (a hint, as the training loader's).
    ``evaluations_started``: how many evaluations have started pulling (loaders built so far). Nothing is saved: the
    stream restarts from the configuration.
    """

    def __init__(self, build: Callable[[bool], Any], batches_per_eval: int, *, seq_length: int | None = None) -> None:
        if not isinstance(batches_per_eval, int) or isinstance(batches_per_eval, bool) or batches_per_eval <= 0:
            raise ValueError(f"BagelValidLoader: batches_per_eval must be a positive integer, got {batches_per_eval!r}")
        self._build = build
        self.batches_per_eval = batches_per_eval
        self.seq_length = seq_length
        self._loader: Any = None
        self._served = 0
        self.evaluations_started = 0

    def __iter__(self) -> "BagelValidLoader":
        return self

    def __len__(self) -> int:
        return self.batches_per_eval

    def __next__(self) -> dict[str, Any]:
        """The next batch of the current evaluation; the first of an evaluation builds the stream afresh. Raises
        ``StopIteration`` only if the validation groups cannot fill one evaluation (they never end: the readers cycle
        over epochs, as training's do)."""
        if self._loader is None:
            self._loader = self._build(self.evaluations_started == 0)
            self.evaluations_started += 1
        try:
            batch = next(self._loader)
        except BaseException:
            self.reset()
            raise
        self._served += 1
        if self._served >= self.batches_per_eval:
            self.reset()  # the evaluation is complete: the next pull starts the stream again
        return batch

    def reset(self) -> None:
        """Close the current stream (if any) so the next pull starts an evaluation from the first batch; as
        ``close()``: release the current stream's readers and processes (idempotent)."""
        loader, self._loader, self._served = self._loader, None, 0
        if loader is not None:
            loader.close()

    close = reset

    def __enter__(self) -> "BagelValidLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
