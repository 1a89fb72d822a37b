"""A rank of ``tests/_warm_torchrun.py``: the job as ``python -m bridge.models.bagel.launch ARGS`` runs it.

torch's agent calls this file (``runpy.run_path``) in a worker forked from it and waits for the worker's return
value, so a rank that succeeds returns here instead of ending its process as the launcher does
(``launch._end_process``); the exit handlers (Energon workers, the prefetch producer, the watchdog's report
directories, logging) run first either way, and a failing rank still ends with its exit code.
"""

import atexit
import os
import sys
import threading

if __name__ == "__main__":
    # the process name tells the forked ranks apart (``ps``; test_train_job kills rank 1 by it): their command
    # lines are the agent's, and so is their environment as /proc shows it
    with open("/proc/self/comm", "w") as comm:
        comm.write(f"bagel-rank{os.environ['RANK']}")
    if os.environ.get("OMP_NUM_THREADS"):  # what torch reads at import, here after it (torchrun sets 1 per rank)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from bridge.models.bagel.launch import main

    code = main(sys.argv[1:])
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
