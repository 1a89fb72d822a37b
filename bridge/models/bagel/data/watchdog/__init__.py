"""The data watchdog: a read that never returns (a mount that stopped answering) becomes one clear error.

Every read that can block the trainer's ``next()`` goes through ``ReadWatch.call``: a group reader's reads
(``energon.readers.core.GroupReader``: inline, or the wait on the rank's read pool), in either order, in the
trainer or in the prefetch producer; the trainer's side of the prefetch queue is watched by ``PrefetchStage`` itself
with a later deadline (a safety net for a producer stuck elsewhere).

Two ways to wait, one behaviour (bit-identical stream with the watchdog on or off):

* **Per batch** (the loader's ``next()`` and the prefetch producer's loop, through ``batch_call``): the whole
  batch is built on one *batch thread* per calling thread, which the caller waits on with a timed get: ONE
  hand-over per batch. Reads inside it run inline and only stamp a slot ("this watch, reading since t"); the
  waiting caller looks at that slot when a limit of the read in progress comes due (at least every 0.5 s).
* **Per read** (any other caller: tests, tools, a reader driven by hand): ``call`` runs each read on a reader
  thread of its own and waits for it the same way.

After ``stall_warn_s`` (config ``data.stall_warn_s``) without the read returning it logs ONE warning line
naming what the chain waits on (group, dataset, the shard file being read when known, which process, for how
long) and the stuck stacks at DEBUG; after ``timeout_s`` (``data.timeout_s``) it raises ``DataTimeoutError``
with that content. 0 disables either. Which shard is found from the stuck thread's frames (the Energon tar
reader's ``tar_file_id`` / sample pointer), so a healthy read costs nothing but the stamp (per batch) or the
thread hand-over (per read).

A thread blocked in the kernel (``open``/``read`` on a dead mount) cannot be cancelled from Python: after a
time-out it stays behind as a daemon thread, the caller gets the error, and the job exits (daemon threads do
not hold up the interpreter's exit; stuck read workers are killed, ``ReadWatch.kill_stuck``).

Worker processes are asked through *agents*: every process forked after ``enable_agents()`` (the rank's read
workers, the prefetch producer and its workers, the workers of a hand-wired Energon loader) gets a daemon thread
that polls a shared counter (4 times a second, lock-free) and, when the watchdog bumps it, writes what its threads
are doing to a report file (``collect_reports``).

Modules: ``watch`` (``ReadWatch``, ``batch_call``, ``DataTimeoutError``, the defaults) and ``stacks`` (what a
stuck thread or process is doing: frames, agents in forked processes, their reports).
"""

from .stacks import collect_reports, describe_frame, enable_agents, summarize
from .watch import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, DataTimeoutError, ReadWatch, batch_call

__all__ = ["DEFAULT_STALL_WARN_S", "DEFAULT_TIMEOUT_S", "DataTimeoutError", "ReadWatch", "batch_call",
           "collect_reports", "describe_frame", "enable_agents", "summarize"]
