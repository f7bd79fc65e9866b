"""Stand-ins for what tests and benchmarks cannot have on one machine, each named as such."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Terminate ``proc`` and wait for it; kill it if it has not ended within ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
