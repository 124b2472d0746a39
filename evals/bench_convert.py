"""fp8-convert against llm-compressor (model_free_ptq and oneshot) on the same random Llama, one run.

Each tool runs in its own process; wall time and that process's peak RSS (os.wait4) are recorded. The
source files are read once before every run so each tool starts with the same warm page cache. The lent
CPU machines are VMs whose memory is backed on first touch (about 0.3 GB/s), which made single runs vary
by 3x; so the script first touches --prefault-gb of memory once, runs every tool --repeats times in
turn, and reports each tool's best run next to all of its runs.

    python evals/bench_convert.py [--out evals/results/convert.json] [--workdir DIR] [--skip-2x]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.results_file import write_json  # noqa: E402


# TinyLlama-1.1B's shape (2.2 GB in bf16), and the same with twice the layers for the flat-RSS check.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
LLAMA_2X = dict(LLAMA_1B, num_hidden_layers=44)

TOOLS = {
    "fp8kit dynamic": "from fp8kit.cli import fp8_convert; import sys; sys.argv[1:] = [SRC, OUT, '--scheme', 'dynamic']; fp8_convert()",
    "fp8kit block": "from fp8kit.cli import fp8_convert; import sys; sys.argv[1:] = [SRC, OUT, '--scheme', 'block']; fp8_convert()",
    # what every fp8kit conversion does before writing: imports, headers, and the weights checked against the model
    # transformers builds from config.json on the meta device (the transformers import is most of it)
    "fp8kit checks only": "from pathlib import Path; from fp8kit.converter.streaming import read_source; read_source(Path(SRC))",
    "llmcompressor model_free_ptq dynamic": (
        "from llmcompressor.entrypoints.model_free import model_free_ptq; "
        "model_free_ptq(SRC, OUT, scheme='FP8_DYNAMIC', ignore=['lm_head'])"),
    "llmcompressor model_free_ptq block": (
        "from llmcompressor.entrypoints.model_free import model_free_ptq; "
        "model_free_ptq(SRC, OUT, scheme='FP8_BLOCK', ignore=['lm_head'])"),
    "llmcompressor oneshot dynamic": (
        "import torch; from transformers import AutoModelForCausalLM; from llmcompressor import oneshot; "
        "from llmcompressor.modifiers.quantization import QuantizationModifier; "
        "m = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16); "
        "oneshot(model=m, recipe=QuantizationModifier(targets='Linear', scheme='FP8_DYNAMIC', ignore=['lm_head'])); "
        "m.save_pretrained(OUT, save_compressed=True)"),
}


def warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def prefault(gb: float) -> None:
    subprocess.run([sys.executable, "-c", f"import torch; torch.ones({int(gb * 2**30)}, dtype=torch.uint8)"], check=True)


def run_tool(code: str, src: Path, out: Path) -> dict:
    warm(src)
    env = {**os.environ, "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # The tool reports its own VmHWM: ru_maxrss from wait4 would carry over this (large) parent's peak
    # through fork and exec.
    hwm = out.with_name("vmhwm.txt")
    prog = (f"SRC, OUT = {str(src)!r}, {str(out)!r}\nimport atexit\n"
            f"atexit.register(lambda: open({str(hwm)!r}, 'w').write(open('/proc/self/status').read()))\n{code}")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", prog], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    status = proc.wait()
    seconds = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"tool failed: {stderr.decode()[-2000:]}")
    peak_kb = int(re.search(r"VmHWM:\s+(\d+) kB", hwm.read_text()).group(1))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    subprocess.run(["rm", "-rf", str(out)], check=True)
    os.sync()
    return {"seconds": round(seconds, 2), "peak_rss_gb": round(peak_kb * 1024 / 1e9, 3), "out_gb": round(size / 1e9, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "evals/results/convert.json"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-2x", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefault-gb", type=float, default=8.0)
    args = ap.parse_args()

    import llmcompressor
    import torch
    import transformers

    import fp8kit
    from fp8kit.models import build_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    models = {"llama-1.1b": LLAMA_1B} if args.skip_2x else {"llama-1.1b": LLAMA_1B, "llama-2.1b": LLAMA_2X}
    for model_name, shape in models.items():
        if not (work / model_name / "config.json").exists():
            build_checkpoint(work / model_name, "llama", torch.bfloat16, seed=0, **shape)
    prefault(args.prefault_gb)
    results: dict[str, dict] = {}
    for model_name in models:
        src = work / model_name
        src_gb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e9
        tools = TOOLS if model_name == "llama-1.1b" else {k: v for k, v in TOOLS.items() if "fp8kit" in k}
        runs: dict[str, list] = {tool: [] for tool in tools}
        for _ in range(args.repeats):
            for tool, code in tools.items():
                runs[tool].append(run_tool(code, src, work / "out"))
                print(model_name, tool, runs[tool][-1], flush=True)
        rows = {tool: {**min(r, key=lambda x: x["seconds"]), "runs": r} for tool, r in runs.items()}
        results[model_name] = {"source_gb": round(src_gb, 3), "tools": rows}

    one = results["llama-1.1b"]["tools"]
    ratios = {
        "dynamic_time_vs_model_free_ptq": one["fp8kit dynamic"]["seconds"] / one["llmcompressor model_free_ptq dynamic"]["seconds"],
        "block_time_vs_model_free_ptq": one["fp8kit block"]["seconds"] / one["llmcompressor model_free_ptq block"]["seconds"],
        "dynamic_time_vs_oneshot": one["fp8kit dynamic"]["seconds"] / one["llmcompressor oneshot dynamic"]["seconds"],
        "dynamic_rss_vs_model_free_ptq": one["fp8kit dynamic"]["peak_rss_gb"] / one["llmcompressor model_free_ptq dynamic"]["peak_rss_gb"],
    }
    if "llama-2.1b" in results:
        two = results["llama-2.1b"]["tools"]
        ratios["dynamic_rss_2x_model_vs_1x"] = two["fp8kit dynamic"]["peak_rss_gb"] / one["fp8kit dynamic"]["peak_rss_gb"]
    report = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "versions": {"fp8kit": fp8kit.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "llmcompressor": llmcompressor.__version__},
        "command": "python evals/bench_convert.py " + " ".join(sys.argv[1:]),
        "models": {k: {"arch": "LlamaForCausalLM (random weights, bf16)", **v} for k, v in models.items()},
        "results": results,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    print(json.dumps(report["ratios"], indent=2))


if __name__ == "__main__":
    main()
