"""Do vLLM engines load and run what fp8-convert writes? One GPU call, every scheme and format.

Builds a Qwen3-shaped random model, converts it with each scheme/format, starts vLLM on each (one
subprocess per engine), greedy-generates from token ids, scores the prompt tokens against the BF16
source in the same vLLM, and records the linear kernel vLLM selected. Also tries block FP8 on a model
whose MLP width is not a multiple of 128, in our layout and in llm-compressor's (partial blocks), and a
`--kv-cache fp8` checkpoint, whose per-layer K/V scales must be the ones vLLM's attention layers use.

    python evals/vllm_load.py --prepare-odd DIR        # on CPU, with llm-compressor: odd model + its FP8_BLOCK
    python evals/vllm_load.py --odd DIR --out evals/results/vllm_load.json   # on the GPU, with vLLM
    python evals/vllm_load.py --variants bf16,dynamic/compressed-tensors+kv-fp8 --out ...   # some of them

A Qwen3-MoE-shaped model is converted too, also with one expert --ignore'd, which keeps every expert of its layer
in BF16: vLLM must give that layer's fused MoE an unquantized method (`moe_methods`).
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


MOE_SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=2048, num_experts=8,
                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024)
QWEN3_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=1024)
ODD_SHAPE = dict(hidden_size=512, intermediate_size=1392, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=1024)  # 1392 % 128 = 112
PROMPTS = [[(i * 37 + j * 11) % 1900 + 50 for j in range(48)] for i in range(4)]
# DeepGEMM / FlashInfer block GEMMs JIT-compile for minutes on a cold start; pin CUTLASS for the smoke test.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_DEEP_GEMM": "0",
              "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}


def engine(path: str) -> dict:
    """Runs inside the subprocess: load, generate, score prompts, report kernels."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.25, skip_tokenizer_init=True,
              enable_flashinfer_autotune=False, seed=0)
    load_s = time.perf_counter() - t0

    def kernels(model):
        found = {}
        for name, module in model.named_modules():
            holder = getattr(module, "scheme", None) or getattr(module, "quant_method", None)
            kernel = getattr(holder, "fp8_linear", None)
            if kernel is not None:
                found[type(holder).__name__] = type(kernel).__name__
        return found

    def kv_scales(model):
        # the scales vLLM's FP8 KV cache quantizes with, set after loading (quantization/kv_cache.py)
        return {name: [module._k_scale_float, module._v_scale_float, str(module.kv_cache_dtype)]
                for name, module in model.named_modules() if hasattr(module, "_k_scale_float")}

    def moe_methods(model):
        # the quantization method each fused MoE layer got: a layer whose experts stay in BF16 must be unquantized
        # (vLLM 0.25: `...mlp.experts.routed_experts`, UnquantizedFusedMoEMethod or CompressedTensorsW8A8Fp8MoEMethod)
        return {name: type(module.quant_method).__name__ for name, module in model.named_modules()
                if "MoEMethod" in type(getattr(module, "quant_method", None)).__name__}

    selected = llm.apply_model(kernels)[0]
    loaded_kv = llm.apply_model(kv_scales)[0]
    moe = llm.apply_model(moe_methods)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    prompt_lp = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return {"load_s": load_s, "kernels": selected, "generated": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_logprobs": prompt_lp, "kv_cache_scales": loaded_kv, **({"moe_methods": moe} if moe else {})}


def kv_scale_agreement(checkpoint: Path, loaded: dict) -> dict:
    """The checkpoint's k_scale/v_scale against those vLLM's attention layers use ({vLLM module name: [k, v,
    kv_cache_dtype]}; vLLM's `...self_attn.attn` holds the checkpoint's `...self_attn.k_scale`)."""
    from safetensors import safe_open

    stored = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            stored.update({k: sf.get_tensor(k).float().item() for k in sf.keys() if k.endswith((".k_scale", ".v_scale"))})
    mismatched, matched = [], 0
    for name, (k, v, _) in sorted(loaded.items()):
        base = name.removesuffix(".attn")
        for kind, value in (("k_scale", k), ("v_scale", v)):
            want = stored.get(f"{base}.{kind}")
            if want is None or value != want:
                mismatched.append([f"{base}.{kind}", want, value])
            else:
                matched += 1
    return {"checkpoint_scales": len(stored), "layers": len(loaded), "scales_equal": matched,
            "mismatched": mismatched[:8], "kv_cache_dtypes": sorted({d for _, _, d in loaded.values()})}


def run_engine(path: Path) -> dict:
    env = {**os.environ, **ENGINE_ENV}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--engine", str(path)], env=env, capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": ["engine did not finish within 300 s"]}
    log = proc.stdout + proc.stderr
    result = {"ok": proc.returncode == 0, "wall_s": round(time.perf_counter() - t0, 1),
              "selected_log": sorted(set(re.findall(r"Selected (\w+) for (\w+)", log)))}
    if proc.returncode == 0:
        result.update(json.loads(log.split("@@RESULT@@")[1]))
    else:
        result["error"] = [l for l in log.splitlines() if "Error" in l or "error" in l][-3:]
    return result


def prepare_odd(directory: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from fp8kit.models import build_checkpoint

    src = build_checkpoint(directory / "src", "qwen3", torch.bfloat16, seed=0, **ODD_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"]))
    model.save_pretrained(directory / "llmc-block", save_compressed=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine")
    ap.add_argument("--out", default=str(ROOT / "evals/results/vllm_load.json"))
    ap.add_argument("--odd", help="directory made by --prepare-odd")
    ap.add_argument("--prepare-odd", help="write the odd-MLP model and llm-compressor's FP8_BLOCK of it here")
    ap.add_argument("--variants", help="comma-separated names of the variants to run (default: all)")
    args = ap.parse_args()
    if args.prepare_odd:
        prepare_odd(Path(args.prepare_odd))
        return
    if args.engine:
        print("@@RESULT@@" + json.dumps(engine(args.engine)) + "@@RESULT@@")
        return

    from fp8kit import convert
    from fp8kit.models import add_tokenizer, build_checkpoint

    # each variant's checkpoint, made only if asked for (the names are checked before any model is built)
    made = {"bf16": lambda: src}
    for scheme, fmt in [("dynamic", "compressed-tensors"), ("block", "compressed-tensors"),
                        ("tensor", "compressed-tensors"), ("block", "fp8"), ("tensor", "fp8")]:
        made[f"{scheme}/{fmt}"] = lambda scheme=scheme, fmt=fmt: Path(
            convert(src, work / f"{scheme}-{fmt}", scheme=scheme, format=fmt).out)
    made["dynamic/compressed-tensors+kv-fp8"] = lambda: Path(
        convert(src, work / "dynamic-kv", scheme="dynamic", kv_cache="fp8").out)
    # Qwen3-MoE: all FP8, and with layer 0's experts kept in BF16 (one --ignore'd expert keeps its whole layer)
    made["bf16-moe"] = lambda: moe_src()
    made["dynamic/compressed-tensors moe"] = lambda: Path(convert(moe_src(), work / "moe-dynamic", scheme="dynamic").out)
    # tensor in the compressed-tensors format is refused for MoE models (vllm_load_moe_schemes_h100.json)
    for scheme, fmt in [("block", "compressed-tensors"), ("tensor", "fp8")]:
        made[f"{scheme}/{fmt} moe"] = lambda scheme=scheme, fmt=fmt: Path(
            convert(moe_src(), work / f"moe-{scheme}-{fmt}", scheme=scheme, format=fmt).out)
    made["dynamic/compressed-tensors moe (layer 0 experts kept bf16)"] = lambda: Path(convert(
        moe_src(), work / "moe-dynamic-ignore", scheme="dynamic", ignore=[r"layers\.0\.mlp\.experts\.3\.down_proj"]).out)

    def moe_src():
        path = work / "qwen3-moe"
        if not path.exists():
            build_checkpoint(path, "qwen3_moe", torch.bfloat16, seed=0, **MOE_SHAPE)
        return path
    if args.odd:
        odd = Path(args.odd)
        made["bf16-odd"] = lambda: odd / "src"
        made["block/compressed-tensors odd-mlp (ours: MLP kept bf16)"] = lambda: Path(
            convert(odd / "src", work / "odd-block", scheme="block").out)
        made["block/compressed-tensors odd-mlp (llm-compressor: partial blocks)"] = lambda: odd / "llmc-block"
    wanted = args.variants.split(",") if args.variants else list(made)
    if unknown := [v for v in wanted if v not in made]:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(made)}")

    import torch
    import vllm

    work = Path(tempfile.mkdtemp(prefix="vllm-load-"))
    src = build_checkpoint(work / "qwen3", "qwen3", torch.bfloat16, seed=0, **QWEN3_SHAPE)
    add_tokenizer(src, (ROOT / "fp8kit/data/sample.txt").read_text(), vocab_size=2048)  # --kv-cache calibrates on text
    variants = {name: made[name]() for name in wanted}

    results = {}
    for name, path in variants.items():
        results[name] = run_engine(path)
        print(name, {k: v for k, v in results[name].items() if k not in ("generated", "prompt_logprobs", "kv_cache_scales")},
              flush=True)
    for name, r in results.items():  # prompt-token logprob drift against the matching BF16 engine
        if r.get("ok") and "kv-fp8" in name:
            r["kv_scale_agreement"] = kv_scale_agreement(variants[name], r["kv_cache_scales"])
        r.pop("kv_cache_scales", None)
        base = results.get("bf16-odd" if "odd" in name else "bf16-moe" if "moe" in name else "bf16", {})
        if r.get("ok") and base.get("ok") and name not in ("bf16", "bf16-odd", "bf16-moe"):
            diffs = [abs(a - b) for pa, pb in zip(r["prompt_logprobs"], base["prompt_logprobs"]) for a, b in zip(pa, pb)]
            r["prompt_logprob_mean_abs_diff_vs_bf16"] = sum(diffs) / len(diffs)
            r["greedy_tokens_equal_bf16"] = r["generated"] == base["generated"]
    for r in results.values():
        r.pop("prompt_logprobs", None)
    # merged into an existing --out, so that one table can be made over several calls (each engine's first start
    # on a fresh machine can take minutes): every call records its machine and versions, every result its call, and
    # a variant's drift is against the BF16 engine of its own call
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    if any("moe" in name for name in wanted):
        report["moe_model"] = {"arch": "Qwen3MoeForCausalLM (random weights)", **MOE_SHAPE}
    report.update({"model": {"arch": "Qwen3ForCausalLM (random weights)", **QWEN3_SHAPE},
                   "engine": {"enforce_eager": True, "env": ENGINE_ENV}})
    calls = report.setdefault("calls", [])
    calls.append({"command": "python evals/vllm_load.py " + " ".join(sys.argv[1:]), "gpu": torch.cuda.get_device_name(0),
                  "vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()})
    report.setdefault("results", {}).update({name: {**r, "call": len(calls) - 1} for name, r in results.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "generated"} for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
