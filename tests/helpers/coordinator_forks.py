"""Coordinator processes for the tests, forked from a process that has already imported
crossfed (as gunicorn's ``--preload`` starts its workers).

``python -m crossfed coordinator serve`` spends about 3 s of CPU importing torch and the web
stack before it serves, and 3 s more importing torchtitan when its run is created (generation
0 is torchtitan's Qwen3 initialisation). The unit tests start about 220 coordinators, so on a
2-core machine those imports were most of the unit suite's CPU. The fork server here imports
them once; each coordinator is then a child forked from it that runs the same
``crossfed coordinator serve`` main (:func:`crossfed.cli.main`) with the same arguments, the
test's environment and working directory, in a session of its own, logging where a spawned
one would. What differs from a spawned coordinator is only how its interpreter was set up;
the tests of how users start one (``crossfed coordinator start``, ``spawn_coordinator``, the
workflow's embedded coordinator) still spawn it.

The child's exit status is reaped by the fork server and written to a file named by its pid;
:class:`ForkedProcess` reads it, offering the part of :class:`subprocess.Popen` the tests use.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

#: imported once by the fork server: what a coordinator imports to serve and to create a run
PRELOAD = ("crossfed.cli", "crossfed.coordinator.app", "crossfed.train.model")


class ForkedProcess:
    """A forked coordinator: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate`` and ``kill``, as :class:`subprocess.Popen` has them."""

    def __init__(self, pid: int, args: list[str], exits: Path) -> None:
        self.pid, self.args, self._exit_file = pid, args, exits / str(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_file.exists():
            self.returncode = int(self._exit_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may already belong to another process
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode} args={self.args}>"


class ForkServer:
    """One fork server process (started at the first launch, stopped by ``close``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._exits = Path(tempfile.mkdtemp(prefix="crossfed-forks-"))

    def launch(self, argv: list[str], log_path: Path) -> ForkedProcess:
        """``crossfed *argv`` in a forked child, its output appended to ``log_path``."""
        request = {"argv": argv, "log": str(log_path), "cwd": os.getcwd(), "env": dict(os.environ)}
        with self._lock:
            server = self._started()
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
        if not reply.strip().isdigit():
            raise RuntimeError(f"the coordinator fork server did not fork: {reply!r}")
        return ForkedProcess(int(reply), ["crossfed", *argv], self._exits)

    def close(self) -> None:
        with self._lock:
            if self._server is not None and self._server.poll() is None:
                assert self._server.stdin is not None
                self._server.stdin.close()  # it exits at the end of its input
                try:
                    self._server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._server.kill()
            self._server = None
            shutil.rmtree(self._exits, ignore_errors=True)

    def _started(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._exits.mkdir(parents=True, exist_ok=True)
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.coordinator_forks", str(self._exits)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a Ctrl-C of the tests is not its
                cwd=Path(__file__).resolve().parents[2],
            )
        return self._server


def _reap(exits: Path) -> None:
    """Every child that has exited: its exit code (Popen's: -N for signal N) to its file."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = exits / f".{pid}"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.rename(exits / str(pid))


def _child(request: dict, told: int) -> NoReturn:
    """The forked child: ``crossfed *argv`` as a spawned coordinator runs it. It ends as an
    interpreter does (non-daemon threads joined, exit handlers run), by ``SystemExit``
    through the fork server's loop, which does not catch it."""
    code = 1
    try:
        os.setsid()
        os.write(told, b"s")
        os.close(told)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, to)
        os.close(log)
        os.close(null)
        sys.argv = ["crossfed", *request["argv"]]
        from crossfed.cli import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.exit(code)


def serve(exits: Path) -> None:
    """Import what a coordinator imports, then fork a child per request line (JSON) on stdin
    and answer its pid on stdout; reap children as they exit."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, lambda *_: _reap(exits))
    for line in sys.stdin:
        request = json.loads(line)
        ready, told = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready)
            _child(request, told)
        os.close(told)
        os.read(ready, 1)  # its own session first: the pid answered is its process group's
        os.close(ready)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
