"""vLLM serving throughput of fp8-convert checkpoints against BF16 and vLLM's own online FP8, one GPU.

Makes a random-weight Qwen3-8B-shaped model on the GPU, converts it with fp8-convert to each scheme (a
"+lm-head" suffix, e.g. tensor+lm-head, converts with --lm-head; "+kv-scales" with --kv-cache fp8 (the checkpoint
asks vLLM for an FP8 KV cache, with calibrated scales); a "+kv-fp8" suffix, e.g. tensor+kv-fp8 or
bf16+kv-fp8, serves the same checkpoint with vLLM's FP8 KV cache, kv_cache_dtype="fp8"), and
serves each variant in its own vLLM engine (a subprocess): output tokens/s for a workload of random
prompt ids with fixed output lengths (ignore_eos), new prompts in every pass, the prompts' prefill time alone,
engine start time, and the weight memory vLLM reports.
Work and results persist in --workdir, so a run can be split over several calls (--variants).

    python evals/serve_bench.py --workdir /tmp/serve --variants bf16,dynamic --out serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.process_group import run_in_group  # noqa: E402
from evals.results_file import write_json  # noqa: E402


MODELS = {
    "qwen3-8b": ("qwen3",
                 dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      tie_word_embeddings=False, rope_theta=1000000.0)),
    "llama-8b": ("llama",
                 dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      tie_word_embeddings=False)),
}
WORKLOADS = {"short": (256, 128, 256), "long": (64, 2048, 512)}  # prompts, input tokens, output tokens
# DeepGEMM / FlashInfer block GEMMs JIT-compile for minutes on a cold start (../shared/gpu/README.md):
# block variants run on the CUTLASS block kernel.
ENGINE_ENV = {"VLLM_USE_DEEP_GEMM": "0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
TIMEOUT = 560
# how a run's prompts were drawn, stored with it: ratios only compare runs measured the same way
NEW_PROMPTS = "new random prompt ids every pass (no prefix-cache hits)"


def workload_prompts(workload: str, pass_index: int) -> list[dict]:
    """Random prompt ids for one pass, different in every pass and the same for every variant.

    Repeating one pass's prompts let vLLM's prefix cache (on by default) skip 112 of each prompt's 128 tokens in
    every pass after the first, so the timed passes measured mostly decode; a server sees new prompts."""
    import random

    n, n_in, _ = WORKLOADS[workload]
    rng = random.Random(pass_index)
    return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(n_in)]} for _ in range(n)]


def engine(path: str, workload: str, quantization: str | None, repeats: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Inside the subprocess: start the engine, run the workload once to warm up, then time it `repeats` times
    on new prompts each time, and time the prompts' prefill alone (one output token) as often."""
    from vllm import LLM, SamplingParams

    _, n_in, n_out = WORKLOADS[workload]
    t0 = time.perf_counter()
    custom_ops = os.environ.get("FP8KIT_BENCH_CUSTOM_OPS")
    extra = {"compilation_config": {"custom_ops": custom_ops.split(",")}} if custom_ops else {}
    llm = LLM(path, quantization=quantization, max_model_len=n_in + n_out + 16, gpu_memory_utilization=0.85,
              skip_tokenizer_init=True, seed=0, max_num_seqs=256, kv_cache_dtype=kv_cache_dtype, **extra)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=0.0, detokenize=False)
    # warm-up: the whole workload once (compilation, CUDA graphs and allocations settle on other prompts)
    llm.generate(workload_prompts(workload, 0), params, use_tqdm=False)

    def timed(pass_index: int, sampling: SamplingParams) -> tuple[float, int]:
        prompts = workload_prompts(workload, pass_index)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    runs = [timed(1 + i, params) for i in range(repeats)]  # one short pass takes ~4 s: the median is steadier
    rates = [tokens / seconds for seconds, tokens in runs]
    one_token = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    prefill = [timed(1 + repeats + i, one_token)[0] for i in range(repeats)]
    median = statistics.median_low(rates)  # a measured pass, whose seconds and tokens are reported with it
    seconds, tokens = runs[rates.index(median)]
    return {"tok_s": median, "tok_s_runs": rates, "seconds": seconds, "output_tokens": tokens,
            "prefill_s": statistics.median(prefill), "prefill_s_runs": prefill, "engine_start_s": start_s,
            "prompts": NEW_PROMPTS}


def run_engine(path: Path, workload: str, quantization: str | None, engine_env: dict, repeats: int = 1,
               kv_cache_dtype: str = "auto") -> dict:
    env = {**os.environ, **engine_env}
    cmd = [sys.executable, __file__, "--engine", str(path), "--workload", workload, "--repeats", str(repeats),
           "--kv-cache-dtype", kv_cache_dtype]
    if quantization:
        cmd += ["--quantization", quantization]
    t0 = time.perf_counter()
    returncode, stdout, stderr = run_in_group(cmd, env, TIMEOUT)
    if returncode is None:
        return {"error": f"engine did not finish within {TIMEOUT} s", "engine_env": engine_env,
                "tail": stderr[-2000:]}
    log = stdout + stderr
    if returncode != 0:
        return {"error": [l for l in log.splitlines() if "Error" in l][-3:], "wall_s": time.perf_counter() - t0}
    result = {**json.loads(log.split("@@RESULT@@")[1]), **engine_log_facts(log)}
    result["wall_s"] = time.perf_counter() - t0
    return result


def engine_log_facts(log: str) -> dict:
    """What vLLM's log says about an engine: weight GiB, the linear kernels it selected, KV-cache tokens, and its
    warnings about KV-cache scales ("Using KV cache scaling factor 1.0" when an FP8 KV cache finds no k/v scales
    in the checkpoint, model_executor/layers/quantization/kv_cache.py; evals/vllm_load.py checks loaded ones)."""
    weights = re.findall(r"Model loading took ([\d.]+) GiB", log)
    kv_tokens = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log)
    return {"weight_gib": float(weights[-1]) if weights else None,
            "kernels": sorted(set(re.findall(r"Selected (\w+) for (\w+)", log))),
            "kv_cache_tokens": int(kv_tokens[-1].replace(",", "")) if kv_tokens else None,
            "kv_scale_log": sorted({l.split("] ", 1)[-1].strip() for l in log.splitlines() if "scaling factor" in l})}


def with_static_scales(tensor_dir: Path, out: Path) -> Path:
    """The per-tensor checkpoint plus a static input_scale per quantized Linear (a fixed 0.05, not calibrated):
    isolates the speed of vLLM's static activation path from llm-compressor's calibration. Speed only."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tensor_dir, tmp, copy_function=os.link)
    index_path = tmp / "model.safetensors.index.json"
    names = []
    for f in sorted(tmp.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            names += [k[: -len("weight_scale")] + "input_scale" for k in sf.keys() if k.endswith(".weight_scale")]
    save_file({n: torch.tensor([0.05], dtype=torch.float32) for n in names}, tmp / "static-input-scales.safetensors")
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({n: "static-input-scales.safetensors" for n in names})
        index_path.unlink()  # a hard link to the tensor checkpoint's index: replace, never edit in place
        index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((tmp / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"].update(dynamic=False, strategy="tensor", observer="minmax")
    (tmp / "config.json").unlink()
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def pass_split(workload: str, result: dict) -> dict:
    """Prefill seconds and the mean decode step of a pass: (pass time - prefill time) / (output tokens - 1).
    An estimate that runs low: vLLM schedules decode steps into the prefill of the last prompts (chunked
    prefill), so a pass costs less than the prefill alone plus its decode steps."""
    if "prefill_s" not in result:  # results from before the prefill timing
        return {}
    n, _, n_out = WORKLOADS[workload]
    pass_s = n * n_out / result["tok_s"]
    return {"prefill_s": result["prefill_s"], "decode_step_ms": 1000 * (pass_s - result["prefill_s"]) / (n_out - 1)}


def is_bf16_run(variant: str) -> bool:
    """A BF16 engine: kernel switches (+deepgemm, +custom_ops=...) do not touch its BF16 GEMMs; +kv-fp8 does.
    A repeat measured by a later call carries "@callN" (see main)."""
    name = variant.split("@")[0]
    return name == "bf16" or name.startswith(("bf16+deepgemm", "bf16+custom_ops="))


def run_key(results: dict, key: str, call: int) -> str:
    """Where a run goes in `results`: a repeat of a run another call measured (or a run stored before calls were
    recorded) gets "@callN", keeping the earlier run, which the ratios of its own call used; a failed one is
    replaced."""
    earlier = results.get(key)
    # an earlier run that failed (no tok_s) is replaced: its retry is the only measurement of the variant
    return f"{key}@call{call}" if earlier and "tok_s" in earlier and earlier.get("call") != call else key


def workload_summaries(results: dict, model: str) -> dict[str, dict]:
    """{"MODEL/WORKLOAD": {variant: tok_s, vs_bf16, vs_bf16_of, prefill_s, decode_step_ms}} from the runs stored in
    `results`. Each variant is compared with a BF16 run measured the same way (runs from before new prompts per
    pass, which have no "prompts" entry, are only compared with each other): the BF16 engine of its own call
    (`call`: one invocation of this script) where there is one, since engines of one call share a warm machine,
    else "bf16", else another BF16 run. `vs_bf16_of` names the BF16 run used."""
    summaries = {}
    for workload in WORKLOADS:
        by_variant = {k.rsplit("/", 1)[1]: v for k, v in results.items()
                      if k.startswith(f"{model}/{workload}/") and "tok_s" in v}
        bf16_runs = sorted((name for name in by_variant if is_bf16_run(name)), key=lambda name: name != "bf16")
        summary = {}
        for name, run in by_variant.items():
            alike = [b for b in bf16_runs if by_variant[b].get("prompts") == run.get("prompts")]
            same_call = [b for b in alike if "call" in run and by_variant[b].get("call") == run["call"]]
            if not alike:
                continue
            ref = (same_call or alike)[0]
            summary[name] = {"tok_s": run["tok_s"], "vs_bf16": run["tok_s"] / by_variant[ref]["tok_s"],
                             "vs_bf16_of": ref, **pass_split(workload, run)}
        if summary:
            summaries[f"{model}/{workload}"] = summary
    return summaries


SCHEMES = ("bf16", "dynamic", "block", "tensor")  # the rows of `results`
OURS = ("dynamic", "block", "tensor", "tensor-static")  # checkpoints fp8-convert writes


def _first_measured(summary: dict) -> dict:
    """{variant: run} without the repeats later calls measured (`@callN`)."""
    return {name: run for name, run in summary.items() if "@" not in name}


def _scheme(variant: str) -> str:
    return variant.split("+")[0]


def scheme_rows(summary: dict) -> dict:
    """`results`: one row per scheme, the summary's row plus `variant`, the run it is: the scheme served with
    vLLM's defaults where the file has that run, else the fastest run of that scheme's checkpoint with engine
    options (+deepgemm, +custom_ops=..., +kv-fp8) or checkpoint options (+lm-head, +kv-scales). Repeats from
    later calls (`@callN`) stay in the summary only."""
    rows = {}
    for scheme in SCHEMES:
        runs = {name: run for name, run in _first_measured(summary).items() if _scheme(name) == scheme
                and (scheme != "bf16" or is_bf16_run(name))}  # bf16+kv-fp8 is no BF16 row
        if runs:
            name = scheme if scheme in runs else max(runs, key=lambda n: runs[n]["vs_bf16"])
            rows[scheme] = {**runs[name], "variant": name}
    return rows


def best_run(summary: dict) -> dict | None:
    """The fastest run of one of our checkpoints against BF16, whatever its options."""
    ours = {name: run for name, run in _first_measured(summary).items() if _scheme(name) in OURS}
    if not ours:
        return None
    name = max(ours, key=lambda n: ours[n]["vs_bf16"])
    return {"variant": name, "tok_s": ours[name]["tok_s"], "vs_bf16": ours[name]["vs_bf16"]}


def summarize(report: dict) -> None:
    """Per-workload summaries of every model's runs; `results` and `best` from the headline model's short one (the
    only model, in files from before `model` was recorded)."""
    models = sorted({key.split("/")[0] for key in report.get("runs", {})})
    headline = report.get("model", {}).get("name") or (models[0] if len(models) == 1 else None)
    for model in models:
        for key, summary in workload_summaries(report["runs"], model).items():
            report.setdefault("results_by_workload", {})[key] = summary
            if key == f"{model}/short" and model == headline:
                report["results"] = scheme_rows(summary)
                report["best"] = best_run(summary)


def build(workdir: Path, model: str) -> Path:
    import torch

    from fp8kit.models import add_tokenizer, build_checkpoint

    src = workdir / model
    if (src / "config.json").exists():
        return src
    arch, shape = MODELS[model]
    build_checkpoint(src, arch, torch.bfloat16, seed=0, device="cuda", **shape)
    torch.cuda.empty_cache()
    # tensor-static and +kv-scales calibrate on text
    add_tokenizer(src, (ROOT / "fp8kit/data/sample.txt").read_text() * 4, vocab_size=2048)
    return src


def parse_variant(variant: str) -> tuple[str, bool, str, bool]:
    """(base, lm_head, kv_cache_dtype, kv_scales) of a variant name such as tensor+lm-head+kv-fp8 or dynamic+kv-scales."""
    base, *suffixes = variant.split("+")
    if set(suffixes) - {"lm-head", "kv-fp8", "kv-scales"}:
        raise SystemExit(f"variant {variant!r}: the suffixes are +lm-head, +kv-fp8 and +kv-scales")
    lm_head, kv_scales = "lm-head" in suffixes, "kv-scales" in suffixes
    for suffix, given in (("+lm-head", lm_head), ("+kv-scales", kv_scales)):
        if given and base in ("bf16", "vllm-online-fp8", "tensor-static-synthetic"):
            raise SystemExit(f"variant {variant!r}: {suffix} applies to fp8-convert schemes only")
    return base, lm_head, "fp8" if "kv-fp8" in suffixes else "auto", kv_scales


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine")
    ap.add_argument("--quantization")
    ap.add_argument("--kv-cache-dtype", default="auto")  # internal: set by a variant's +kv-fp8 suffix
    ap.add_argument("--workload", default="short")
    ap.add_argument("--model", default="qwen3-8b", choices=list(MODELS))
    ap.add_argument("--workloads", default="short")
    ap.add_argument("--variants", default="bf16,dynamic,block,tensor,tensor-static,vllm-online-fp8")
    ap.add_argument("--workdir", default="/tmp/serve-bench")
    ap.add_argument("--out", default=str(ROOT / "evals/results/serve.json"))
    ap.add_argument("--deep-gemm", action="store_true",
                    help="leave vLLM's default block kernels (DeepGEMM/FlashInfer, JIT-compiled on first start) on")
    ap.add_argument("--timeout", type=int, default=560, help="seconds one engine may take")
    ap.add_argument("--custom-ops", help="vLLM compilation custom_ops, e.g. +quant_fp8")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per engine; tok_s is their median")
    ap.add_argument("--summarize", action="store_true",
                    help="only rewrite --out's summaries (results, best, results_by_workload) from its runs")
    ap.add_argument("--prepare", action="store_true",
                    help="only make the model and convert the variants into --workdir (split a long run over calls)")
    args = ap.parse_args()
    global TIMEOUT
    TIMEOUT = args.timeout
    if args.engine:
        print("@@RESULT@@" + json.dumps(engine(args.engine, args.workload, args.quantization, args.repeats,
                                                   args.kv_cache_dtype)) + "@@RESULT@@")
        return

    if args.summarize:
        report = json.loads(Path(args.out).read_text())
        if not report.get("runs"):
            sys.exit(f"{args.out}: no runs to summarize (results of serve_bench.py hold them under 'runs')")
        summarize(report)
        write_json(Path(args.out), report)
        print(json.dumps({"results": report.get("results"), "best": report.get("best")}, indent=1))
        return
    variants = {v: parse_variant(v) for v in args.variants.split(",")}  # before an 8B model is built
    import torch
    import vllm

    from fp8kit import convert

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src = build(workdir, args.model)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report.update({"gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "torch": torch.__version__,
                   "python": platform.python_version(),
                   "workloads": {k: dict(zip(("prompts", "input_tokens", "output_tokens"), v)) for k, v in WORKLOADS.items()},
                   "engine_env": ENGINE_ENV})
    report.setdefault("models", {})[args.model] = MODELS[args.model][1]
    if args.model == "qwen3-8b" or "model" not in report:
        report["model"] = {"name": args.model, **MODELS[args.model][1]}
    report.setdefault("commands", []).append("python evals/serve_bench.py " + " ".join(sys.argv[1:]))
    results = report.setdefault("runs", {})
    for variant, (base, lm_head, kv_cache_dtype, kv_scales) in variants.items():
        if base == "bf16":
            path, quantization = src, None
        elif base == "vllm-online-fp8":
            path, quantization = src, "fp8"
        elif base == "tensor-static-synthetic":
            tensor_dir = workdir / f"{args.model}-tensor"
            if not (tensor_dir / "config.json").exists():
                convert(src, tensor_dir, scheme="tensor", device="cuda")
            path, quantization = with_static_scales(tensor_dir, workdir / f"{args.model}-{base}"), None
        else:
            # fp8-convert --scheme BASE (--lm-head: lm_head in FP8 as well; --kv-cache fp8: calibrated KV-cache
            # scales, with which vLLM turns on its FP8 KV cache by itself)
            name = base + ("+lm-head" if lm_head else "") + ("+kv-scales" if kv_scales else "")
            path, quantization = workdir / f"{args.model}-{name}", None
            if not (path / "config.json").exists():
                t0 = time.perf_counter()
                convert(src, path, scheme=base, device="cuda", lm_head=lm_head, kv_cache="fp8" if kv_scales else None)
                results.setdefault(f"{args.model}/convert", {})[name] = {"seconds": time.perf_counter() - t0}
        if args.prepare:
            continue
        for workload in args.workloads.split(","):
            key = (f"{args.model}/{workload}/{variant}" + ("+deepgemm" if args.deep_gemm else "")
                   + (f"+custom_ops={args.custom_ops}" if args.custom_ops else ""))
            engine_env = {} if args.deep_gemm else dict(ENGINE_ENV)
            if args.custom_ops:
                engine_env["FP8KIT_BENCH_CUSTOM_OPS"] = args.custom_ops
            call = len(report["commands"]) - 1  # which command in `commands` measured it
            key = run_key(results, key, call)
            results[key] = {**run_engine(path, workload, quantization, engine_env, args.repeats, kv_cache_dtype),
                            "call": call}
            print(key, results[key], flush=True)
            write_json(out, report)
    summarize(report)
    write_json(out, report)


if __name__ == "__main__":
    main()
