"""The FP8 LoRA step's GEMMs alone: row-wise scaled FP8 (torch._scaled_mm) with and without fast accumulation
against BF16, on the Qwen3-8B layer shapes of bench_fp8_lora.py, side by side in one run (GPU).

Fast accumulation keeps Hopper's FP8 tensor-core accumulator without the periodic float32 promotion; vLLM's
CUTLASS FP8 kernels for SM90 all use it (KernelTmaWarpSpecializedPingpongFP8FastAccum in
csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh), so it is also the accumulation the
rollout engine does. Each row: TFLOP/s of each GEMM and the relative error of its bf16 output against a float64
product of the same FP8 operands.

    python evals/bench_fp8_gemm.py [--tokens 8192] [--out evals/results/fp8_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.results_file import write_json  # noqa: E402


# (name, N out, K in) of one Qwen3-8B decoder layer; the input gradient of each is a GEMM with N and K swapped
LAYER = [("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("o_proj", 4096, 4096), ("gate_proj", 12288, 4096),
         ("down_proj", 4096, 12288)]


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def measure(m: int, n: int, k: int) -> dict:
    from fp8kit.rl.fp8_linear import quantize_activation

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    xq, xs = quantize_activation(x, "dynamic")
    wq, ws = quantize_activation(w, "dynamic")  # per output channel
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    flops = 2 * m * n * k
    row = {"m": m, "n": n, "k": k}
    for fast in (False, True):
        fn = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16,  # noqa: E731
                                      use_fast_accum=fast)
        out = fn()
        key = "fp8_fast_accum" if fast else "fp8"
        row[key] = {"tflops": flops / timed(fn) / 1e12,
                    "rel_error_vs_float64": ((out.double() - ref).norm() / ref.norm()).item()}
    wt = w.t().contiguous().t()
    row["bf16"] = {"tflops": flops / timed(lambda: x @ wt.t()) / 1e12}
    row["fast_over_exact"] = row["fp8_fast_accum"]["tflops"] / row["fp8"]["tflops"]
    row["fast_over_bf16"] = row["fp8_fast_accum"]["tflops"] / row["bf16"]["tflops"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the activation (batch 4 x 2048 in the LoRA bench)")
    ap.add_argument("--out", default=str(ROOT / "evals/results/fp8_gemm.json"))
    args = ap.parse_args()
    rows = {}
    for name, n, k in LAYER:
        rows[f"{name} forward"] = measure(args.tokens, n, k)
        rows[f"{name} input grad"] = measure(args.tokens, k, n)
    total = {key: sum(2 * r["m"] * r["n"] * r["k"] / r[key]["tflops"] for r in rows.values()) / 1e12
             for key in ("fp8", "fp8_fast_accum", "bf16")}
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
              "command": "python evals/bench_fp8_gemm.py " + " ".join(sys.argv[1:]),
              "seconds_for_all_shapes": total,
              "fast_accum_speedup": total["fp8"] / total["fp8_fast_accum"],
              "fp8_fast_accum_over_bf16": total["bf16"] / total["fp8_fast_accum"],
              "fp8_exact_over_bf16": total["bf16"] / total["fp8"], "shapes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("gpu", "fast_accum_speedup", "fp8_fast_accum_over_bf16",
                                             "fp8_exact_over_bf16")}))


if __name__ == "__main__":
    main()
