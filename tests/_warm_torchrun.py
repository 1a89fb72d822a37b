"""``torchrun`` for the suite's multi-rank job tests, with ranks that start warm.

A launch is ``torchrun [options] --run-path --start-method fork tests/_warm_rank.py [job arguments]`` run by torch's
own elastic agent (rendezvous, restarts with ``--max-restarts``, gloo process groups), in a process that has the
job's modules imported already (torch, Megatron-Core, Megatron-Bridge, transformers, this package): each rank is
forked from that agent and skips its ~12 CPU-seconds of imports (on 2 cores, 4 ranks importing at once took
~25 s of a ~30 s launch). Loading modules is the only thing done ahead: no process group, no config, no data --
and the root logger is put back as a fresh interpreter has it (``megatron.training`` configures it at import; the
job's own ``logging.basicConfig`` must be the one that takes effect, as when a rank imports it).

Two ways to get that agent (``warm_torchrun``):

* ``server=True`` (the default): one *zygote* per test process (``--serve``), started at its first launch, imports
  once and forks an agent per launch. The command returned is a small client (``--client``) that hands the zygote
  its cwd, environment and stdin/stdout/stderr and exits with the agent's exit code; if the client dies (a test's
  time-out), the zygote kills the agent's process group. The agent's and ranks' command lines are the zygote's.
* ``server=False``: the command imports and becomes the agent itself (its command line is the launch's, which
  ``test_watchdog`` scans for processes left behind).

The launch itself (console script, ``-m bridge.models.bagel.launch``, a cold rank's start-up phases and its
import notes) stays under the real ``python -m torch.distributed.run`` in ``test_launch``, ``test_main_job``
(the README's main job) and run A of ``test_train_job``. A warm rank names its process ``bagel-rank<RANK>``
(``tests/_warm_rank.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_ZYGOTE: dict[str, object] = {}  # this test process's zygote: "proc", "path"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (other launches may run beside this one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def warm_torchrun(nproc: int, job_args: list[str], *, options: tuple[str, ...] = (), server: bool = True) -> list[str]:
    """The command line: ``nproc`` warm ranks on 127.0.0.1 (a free port) running the job; ``options`` go to
    torchrun, ``server`` picks the zygote (module docstring)."""
    torchrun = [f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                *options]
    mode = ["--client", _zygote()] if server else ["--agent"]
    return [sys.executable, str(Path(__file__).resolve()), *mode, *torchrun, "--", *job_args]


def zygote_pid() -> int | None:
    """The pid of this test process's zygote (the parent of every agent it forked), None before the first launch."""
    proc = _ZYGOTE.get("proc")
    return proc.pid if proc is not None else None


def _zygote() -> str:
    """The socket path of this test process's zygote, started (and waited for) at the first call."""
    proc = _ZYGOTE.get("proc")
    if proc is None or proc.poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="bagel-zygote-"), "socket")
        env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", path], env=env,
                                stdin=subprocess.DEVNULL)
        atexit.register(shutil.rmtree, os.path.dirname(path), True)
        atexit.register(proc.kill)  # runs first (last registered): the zygote, then its socket's directory
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm torchrun zygote did not start (exit {proc.poll()})")
            time.sleep(0.05)
        _ZYGOTE.update(proc=proc, path=path)
    return str(_ZYGOTE["path"])


def _import_the_job() -> None:
    sys.path.insert(0, str(REPO))
    from bridge.models.bagel.data._bridge import import_bridge, import_bridge_training

    import bridge.models.bagel.data.job.runner  # noqa: F401
    import bridge.models.bagel.launch  # noqa: F401

    import_bridge()
    import_bridge_training()
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)


def _torchrun_argv(argv: list[str]) -> list[str]:
    split = argv.index("--")
    return [*argv[:split], "--run-path", "--start-method", "fork", str(Path(__file__).with_name("_warm_rank.py")),
            *argv[split + 1:]]


def _agent(argv: list[str]) -> int:
    """Run torch's agent with ``argv`` in this process; its exit code (torchrun's own: 1 when a worker failed)."""
    from torch.distributed.run import main

    sys.argv = ["torchrun", *argv]
    try:
        main(argv)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 -- torchrun prints the failure and exits 1 the same way
        traceback.print_exc()
        return 1


def _serve(path: str) -> None:
    """The zygote: import once, then per connection fork an agent with the client's fds, cwd and environment,
    send back its exit code; kill its process group if the client goes away first."""
    _import_the_job()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(4)
    os.rename(path + ".tmp", path)
    server.settimeout(1.0)
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the test process that started it
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        chunk = msg
        while chunk and not msg.endswith(b"\n"):  # the request is one line; a stream may deliver it in pieces
            chunk = conn.recv(1 << 16)
            msg += chunk
        if not msg.endswith(b"\n") or len(fds) != 3:  # the client went away mid-request
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            code = _agent(request["argv"])
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)
        for fd in fds:
            os.close(fd)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                with contextlib.suppress(OSError):  # the client may be gone
                    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                break
            if select.select([conn], [], [], 0.05)[0] and not conn.recv(1):  # the client is gone
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                time.sleep(0.05)
        conn.close()


def _client(path: str, argv: list[str]) -> int:
    """Hand this process's cwd, environment and stdin/stdout/stderr to the zygote; the agent's exit code."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"argv": _torchrun_argv(argv), "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reply = conn.recv(64)
    code = int(reply) if reply else 1
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve(sys.argv[2])
    elif sys.argv[1] == "--client":
        sys.exit(_client(sys.argv[2], sys.argv[3:]))
    else:  # --agent
        _import_the_job()
        sys.exit(_agent(_torchrun_argv(sys.argv[2:])))
