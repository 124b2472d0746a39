"""A benchmark's child process run in its own process group, so a timeout kills what it started as well.

vLLM's engine runs in a grandchild (EngineCore) and torch.compile starts worker processes; killing only the
child would leave them holding the GPU and its memory for the next measurement."""

from __future__ import annotations

import os
import signal
import subprocess


def run_in_group(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> tuple[int | None, str, str]:
    """(returncode, stdout, stderr) of cmd; returncode None when it ran past timeout and its group was killed."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group exited between the timeout and the kill
            pass
        stdout, stderr = proc.communicate()
        return None, stdout, stderr
