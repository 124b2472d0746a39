"""The runtime's rollout rate against a standalone vLLM engine, pooled over rounds of grpo_gpu.py.

On the lent H100s the decode loop of a 1.1B model is bound by the host's CPU, and that CPU's speed drifts within
minutes: one engine's steady per-step rates on the same workload spanned 11.0k-17.7k tokens/s, so a runtime run
against a standalone run minutes later gave anything from 0.80 to 1.25 (results/grpo_gpu_rounds.json). A round is one
grpo_gpu.py results file whose fp8 run holds the runtime and the standalone engine(s) run right after it on the
same machine; this pools the rounds: every steady step of every round (the first step of each engine is dropped, as
grpo_gpu does), the median of all of them on each side, and each round's own ratio. With --headline the pooled ratio
becomes that file's `rollout_vs_standalone_vllm` (the single run's stays in its per-shape summary).

    python evals/rollout_rounds.py R1.json R2.json R3.json R4.json --out evals/results/grpo_gpu_rounds.json \\
        --headline evals/results/grpo_gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evals.grpo_gpu import STANDALONE_SETTINGS, steady_steps  # noqa: E402
from evals.results_file import write_json  # noqa: E402

STANDALONES = dict(STANDALONE_SETTINGS.values())  # a run's key for a standalone engine -> the ratio's name


def read_round(path: Path, run_key: str) -> dict:
    """One round: the runtime's and each standalone engine's steady per-step rates, and the collector's time."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a readable grpo_gpu.py results file ({e})")
    run = report.get("runs", {}).get(run_key)
    if not run or not run.get("steps"):
        raise SystemExit(f"{path}: no runtime run {run_key!r} with steps; pass files written by evals/grpo_gpu.py")
    steady = [s["rollout_tokens_per_s"] for s in steady_steps(run["steps"], run.get("memory_trace", {}).get("step"))]
    found = {"file": path.name, "gpu": report.get("gpu"), "vllm": report.get("vllm"), "torch": report.get("torch"),
             "commands": report.get("commands", []),
             "runtime": {"steady_rates": steady, "median": statistics.median(steady),
                         "gc_s_per_generation": _mean_gc(run)}}
    for key in STANDALONES:
        if "per_step" in run.get(key, {}):
            rates = run[key]["per_step"][1:] or run[key]["per_step"]
            found[key] = {"steady_rates": rates, "median": statistics.median(rates),
                          "gc_s_per_generation": _mean_gc(run[key])}
    if "standalone" not in found:
        raise SystemExit(f"{path}: the {run_key!r} run has no standalone engine; run grpo_gpu.py without "
                         f"--skip-standalone, or add one with --standalone-only")
    return found


def _mean_gc(run: dict) -> float | None:
    gcs = [g["gc_s"] for g in run.get("gc_in_generation", [])]
    return sum(gcs) / len(gcs) if gcs else None


def pool(rounds: list[dict]) -> dict:
    """Per standalone kind: the ratio of the pooled step medians (the headline), each round's ratio of medians and
    their geometric mean, over the rounds that ran that kind."""
    pooled = {}
    for key, name in STANDALONES.items():
        both = [r for r in rounds if key in r]
        if not both:
            continue
        ratios = [r["runtime"]["median"] / r[key]["median"] for r in both]
        runtime = statistics.median([x for r in both for x in r["runtime"]["steady_rates"]])
        standalone = statistics.median([x for r in both for x in r[key]["steady_rates"]])
        pooled[name] = {"ratio_of_pooled_medians": runtime / standalone, "runtime_median": runtime,
                        "standalone_median": standalone, "rounds": len(both), "round_ratios": ratios,
                        "geometric_mean_of_round_ratios": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                        "steps": [sum(len(r["runtime"]["steady_rates"]) for r in both),
                                  sum(len(r[key]["steady_rates"]) for r in both)]}
    return pooled


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="+", type=Path, help="grpo_gpu.py results files, one round each")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run", default="tinyllama-1.1b/fp8", help="the run pooled in every file (shape/variant)")
    ap.add_argument("--headline", type=Path, help="a grpo_gpu.py results file whose rollout_vs_standalone_vllm "
                    "becomes the pooled ratio")
    args = ap.parse_args(argv)
    rounds = [read_round(p, args.run) for p in args.rounds]
    pooled = pool(rounds)
    headline = None
    if args.headline:
        try:
            headline = json.loads(args.headline.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{args.headline}: not a readable grpo_gpu.py results file ({e})")
    result = {"run": args.run, "command": "python evals/rollout_rounds.py " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
              "pooled": pooled, "rounds": rounds}
    write_json(args.out, result)
    if headline is not None:
        headline["rollout_vs_standalone_vllm"] = pooled["rollout_vs_standalone_vllm"]["ratio_of_pooled_medians"]
        headline["rollout_vs_standalone_vllm_from"] = {
            "file": args.out.name, "rounds": pooled["rollout_vs_standalone_vllm"]["rounds"],
            "round_ratios": pooled["rollout_vs_standalone_vllm"]["round_ratios"]}
        write_json(args.headline, headline)
    for name, p in pooled.items():
        print(f"{name}: {p['ratio_of_pooled_medians']:.3f} (pooled step medians {p['runtime_median']:.0f} / "
              f"{p['standalone_median']:.0f} tok/s over {p['rounds']} rounds; rounds "
              f"{', '.join(f'{r:.3f}' for r in p['round_ratios'])})")


if __name__ == "__main__":
    main()
