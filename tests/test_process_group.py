"""The benchmarks' child runner: a timeout kills the child's whole process group (vLLM's EngineCore is a
grandchild), and a finished child's output and exit status come back."""

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("process_group", ROOT / "evals" / "process_group.py")
process_group = importlib.util.module_from_spec(spec)
spec.loader.exec_module(process_group)

# a child that starts a grandchild (as vLLM starts EngineCore), records its pid, then hangs
HANGING = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
print("started", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_timeout_kills_the_grandchild(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    returncode, stdout, _ = process_group.run_in_group([sys.executable, "-c", HANGING, str(pid_file)], timeout=5)
    assert returncode is None and "started" in stdout
    assert time.monotonic() - t0 < 60
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"grandchild {pid} outlived the timeout"


def test_a_finished_child_returns_its_output():
    returncode, stdout, stderr = process_group.run_in_group(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        env={**os.environ}, timeout=60)
    assert (returncode, stdout, stderr) == (3, "out\n", "err\n")
