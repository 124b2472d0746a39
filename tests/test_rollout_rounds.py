"""evals/rollout_rounds.py: pooling grpo_gpu.py rounds, on results files written here."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals import rollout_rounds  # noqa: E402


def write_round(path: Path, runtime: list[float], standalone: list[float] | None, same_settings=None, gc=None):
    run = {"steps": [{"step": i + 1, "rollout_tokens_per_s": r} for i, r in enumerate(runtime)],
           "gc_in_generation": [{"gc_s": g, "gc_full_collections": 1} for g in gc or []]}
    if standalone is not None:
        run["standalone"] = {"per_step": standalone}
    if same_settings is not None:
        run["standalone_runtime_settings"] = {"per_step": same_settings}
    path.write_text(json.dumps({"gpu": "test", "vllm": "0", "torch": "0", "commands": ["c"],
                                "runs": {"tinyllama-1.1b/fp8": run}}))
    return path


def test_rounds_pool_every_steady_step_and_keep_each_rounds_ratio(tmp_path):
    # the first step of every engine is dropped: 1.0 and 99.0 never count
    a = write_round(tmp_path / "a.json", [1.0, 10, 12, 14], [99.0, 10, 10, 10], [1.0, 20, 20, 20], gc=[0.1, 0.3])
    b = write_round(tmp_path / "b.json", [1.0, 8, 8, 8], [99.0, 16, 16, 16])
    headline = tmp_path / "grpo_gpu.json"
    headline.write_text(json.dumps({"rollout_vs_standalone_vllm": 0.5, "summary": {"x": {"rollout_vs_standalone_vllm": 0.5}}}))
    out = tmp_path / "rounds.json"
    rollout_rounds.main([str(a), str(b), "--out", str(out), "--headline", str(headline)])
    result = json.loads(out.read_text())
    vllm = result["pooled"]["rollout_vs_standalone_vllm"]
    # runtime steps 10,12,14,8,8,8 -> median 9; standalone 10,10,10,16,16,16 -> median 13
    assert vllm["runtime_median"] == 9 and vllm["standalone_median"] == 13
    assert vllm["ratio_of_pooled_medians"] == pytest.approx(9 / 13)
    assert vllm["round_ratios"] == pytest.approx([12 / 10, 8 / 16])
    assert vllm["geometric_mean_of_round_ratios"] == pytest.approx(math.sqrt(1.2 * 0.5))
    assert vllm["rounds"] == 2 and vllm["steps"] == [6, 6]
    same = result["pooled"]["rollout_vs_standalone_runtime_settings"]  # only round a ran it
    assert same["rounds"] == 1 and same["ratio_of_pooled_medians"] == pytest.approx(12 / 20)
    assert result["rounds"][0]["runtime"]["gc_s_per_generation"] == pytest.approx(0.2)
    assert result["rounds"][1]["runtime"]["gc_s_per_generation"] is None
    top = json.loads(headline.read_text())
    assert top["rollout_vs_standalone_vllm"] == pytest.approx(9 / 13)
    assert top["rollout_vs_standalone_vllm_from"]["rounds"] == 2
    assert top["summary"]["x"]["rollout_vs_standalone_vllm"] == 0.5  # the single run's ratio stays where it was


def test_a_round_without_a_standalone_engine_stops_with_one_line_and_writes_nothing(tmp_path):
    a = write_round(tmp_path / "a.json", [1.0, 10, 12], [5.0, 10, 10])
    bare = write_round(tmp_path / "bare.json", [1.0, 10, 12], None)
    out = tmp_path / "rounds.json"
    proc = subprocess.run([sys.executable, str(ROOT / "evals/rollout_rounds.py"), str(a), str(bare), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{bare}: the 'tinyllama-1.1b/fp8' run has no standalone")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "bare.json"]


def test_a_file_that_is_not_json_names_itself(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SystemExit, match="broken.json: not a readable grpo_gpu.py results file"):
        rollout_rounds.main([str(broken), "--out", str(tmp_path / "o.json")])


def test_a_file_without_the_runtime_run_names_the_run(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": {"llama-8b/fp8": {"steps": [{"step": 1, "rollout_tokens_per_s": 1.0}]}}}))
    with pytest.raises(SystemExit, match="other.json: no runtime run 'tinyllama-1.1b/fp8' with steps"):
        rollout_rounds.main([str(other), "--out", str(tmp_path / "o.json")])
    rollout_rounds.main([str(write_round(tmp_path / "a.json", [1.0, 10], [5.0, 10])), "--run", "tinyllama-1.1b/fp8",
                         "--out", str(tmp_path / "o.json")])
    assert (tmp_path / "o.json").exists()


def test_an_unreadable_headline_file_stops_before_anything_is_written(tmp_path):
    a = write_round(tmp_path / "a.json", [1.0, 10, 12], [5.0, 10, 10])
    headline = tmp_path / "grpo_gpu.json"
    headline.write_text("not json")
    out = tmp_path / "rounds.json"
    with pytest.raises(SystemExit, match="grpo_gpu.json: not a readable grpo_gpu.py results file"):
        rollout_rounds.main([str(a), "--out", str(out), "--headline", str(headline)])
    assert not out.exists() and headline.read_text() == "not json"
