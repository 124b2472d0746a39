"""Results JSON written whole or not at all. The benchmarks merge into files that hold earlier runs, so a run killed
mid-write (a device call's time limit, Ctrl-C) must leave the previous file as it was: a temp file beside the
target, renamed over it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
