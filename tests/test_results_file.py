import json
import os

import pytest

from evals import results_file
from evals.results_file import write_json


def test_results_written_whole_or_the_previous_file_kept(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    write_json(out, {"runs": {"a": 1}})
    assert json.loads(out.read_text()) == {"runs": {"a": 1}}
    written = []

    def interrupted(src, dst):  # the run is killed after the new text is written, before it is renamed over
        written.append(json.loads(open(src).read()))
        raise KeyboardInterrupt

    monkeypatch.setattr(results_file.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(out, {"runs": {"a": 1, "b": 2}})
    assert written == [{"runs": {"a": 1, "b": 2}}]
    assert json.loads(out.read_text()) == {"runs": {"a": 1}}
    assert os.listdir(tmp_path) == ["results.json"]  # no temp file left beside it
