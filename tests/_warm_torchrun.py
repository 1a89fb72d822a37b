"""``torchrun`` for the suite's multi-rank job tests, with ranks that start warm.

``python tests/_warm_torchrun.py [torchrun options] -- [job arguments]`` is ``torchrun [torchrun options]
--run-path --start-method fork tests/_warm_rank.py [job arguments]`` whose agent imported the job's modules
(torch, Megatron-Core, Megatron-Bridge, transformers, this package) before it starts its workers: torch's own
elastic agent, rendezvous, restarts (``--max-restarts``) and gloo process groups, but each rank is forked from
the agent and skips its ~12 CPU-seconds of imports (on 2 cores, 4 ranks importing at once took ~25 s of a
~30 s launch). Loading the modules is the only thing done ahead: no process group, no config, no data -- and
the root logger is put back as a fresh interpreter has it (Megatron's ``megatron.training`` configures it at
import; the job's own ``logging.basicConfig`` must be the one that takes effect, as when a rank imports it).

The launch itself (console script, ``-m bridge.models.bagel.launch``, a cold rank's start-up and its import
notes) stays under the real ``python -m torch.distributed.run`` in ``test_launch``, ``test_main_job``,
``test_fresh_stream`` and ``test_train_job``.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def warm_torchrun(nproc: int, job_args: list[str], *, port: int | None = None,
                  options: tuple[str, ...] = ()) -> list[str]:
    """The command line: ``nproc`` warm ranks on 127.0.0.1 (a free port unless ``port``) running the job."""
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    return [sys.executable, str(Path(__file__).resolve()), f"--nproc-per-node={nproc}", "--master-addr",
            "127.0.0.1", "--master-port", str(port), *options, "--", *job_args]


def _main(argv: list[str]) -> None:
    split = argv.index("--")
    sys.path.insert(0, str(REPO))
    from bridge.models.bagel.data._bridge import import_bridge, import_bridge_training

    import bridge.models.bagel.data.job.runner  # noqa: F401
    import bridge.models.bagel.launch  # noqa: F401

    import_bridge()
    import_bridge_training()
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    from torch.distributed.run import main

    main([*argv[:split], "--run-path", "--start-method", "fork", str(Path(__file__).with_name("_warm_rank.py")),
          *argv[split + 1:]])


if __name__ == "__main__":
    _main(sys.argv[1:])
