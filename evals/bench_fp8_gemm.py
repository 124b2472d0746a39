"""The FP8 LoRA step's GEMMs alone: row-wise scaled FP8 (torch._scaled_mm) with and without fast accumulation
against BF16, on the Qwen3-8B layer shapes of bench_fp8_lora.py, side by side in one run (GPU).

Fast accumulation keeps Hopper's FP8 tensor-core accumulator without the periodic float32 promotion; vLLM's
CUTLASS FP8 kernels for SM90 all use it (KernelTmaWarpSpecializedPingpongFP8FastAccum in
csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh), so it is also the accumulation the
rollout engine does. Each row: TFLOP/s of each GEMM and the relative error of its bf16 output against a float64
product of the same FP8 operands.

With --block, the 1x128 x 128x128 block GEMMs instead: cuBLAS (F.scaled_mm, SM90 only), fp8kit's Triton kernel
(what block layers run on every other FP8 GPU: L4, RTX 40/50, Blackwell) and torchao's Triton blockwise_fp8_gemm
when installed, against BF16, with the same error measure.

    python evals/bench_fp8_gemm.py [--tokens 8192] [--block] [--out evals/results/fp8_gemm.json]
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


def measure_block(m: int, n: int, k: int) -> dict:
    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl.fp8_linear import cublas_block_scaling, quantize_activation
    from fp8kit.rl.triton_block_gemm import block_scaled_mm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    xq, xs = quantize_activation(x, "block")
    wq, ws = quantize_weight(w.float(), SCHEMES["block"], torch.float32)
    ref = ((xq.double().reshape(m, -1, 128) * xs.double()[:, :, None]).reshape(m, k)
           @ (wq.double() * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).t())
    flops = 2 * m * n * k
    kernels = {"triton": lambda: block_scaled_mm_triton(xq, wq, xs, ws, torch.bfloat16)}
    if cublas_block_scaling(x.device):
        import torch.nn.functional as F

        xs_t = xs.t().contiguous().t()
        kernels["cublas"] = lambda: F.scaled_mm(xq, wq.t(), xs_t, F.ScalingType.BlockWise1x128, ws.t(),  # noqa: E731
                                                F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    try:
        from torchao.kernel.blockwise_quantization import blockwise_fp8_gemm

        kernels["torchao"] = lambda: blockwise_fp8_gemm(xq, xs, wq, ws, block_size=128)  # noqa: E731
    except ImportError:
        pass
    row = {"m": m, "n": n, "k": k}
    for name, fn in kernels.items():
        out = fn()
        row[name] = {"tflops": flops / timed(fn) / 1e12,
                     "rel_error_vs_float64": ((out.double() - ref).norm() / ref.norm()).item()}
    wt = w.t().contiguous().t()
    row["bf16"] = {"tflops": flops / timed(lambda: x @ wt.t()) / 1e12}
    for name in kernels:
        row[f"{name}_over_bf16"] = row[name]["tflops"] / row["bf16"]["tflops"]
    return row


def main_block(args):
    """Written after every shape, so that a run cut short keeps the shapes it measured (totals over those)."""
    rows = {}
    for name, n, k in LAYER:
        for label, shape in ((f"{name} forward", (n, k)), (f"{name} input grad", (k, n))):
            rows[label] = measure_block(args.tokens, *shape)
            report = block_report(rows)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, report)
            print(label, json.dumps(rows[label]), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "shapes"}))


def block_report(rows: dict) -> dict:
    names = [key for key in ("triton", "cublas", "torchao", "bf16") if key in next(iter(rows.values()))]
    total = {key: sum(2 * r["m"] * r["n"] * r["k"] / r[key]["tflops"] for r in rows.values()) / 1e12 for key in names}
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
              "command": "python evals/bench_fp8_gemm.py " + " ".join(sys.argv[1:]),
              "seconds_for_all_shapes": total,
              **{f"{key}_over_bf16": total["bf16"] / total[key] for key in names if key != "bf16"},
              **({"triton_over_cublas": total["cublas"] / total["triton"]} if "cublas" in total else {}),
              **({"triton_over_torchao": total["torchao"] / total["triton"]} if "torchao" in total else {}),
              "shapes": rows}
    try:
        import torchao

        report["torchao"] = torchao.__version__
    except ImportError:
        pass
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the activation (batch 4 x 2048 in the LoRA bench)")
    ap.add_argument("--out", default=str(ROOT / "evals/results/fp8_gemm.json"))
    ap.add_argument("--block", action="store_true", help="the 128x128-block GEMMs: cuBLAS, fp8kit's Triton, torchao")
    args = ap.parse_args()
    if args.block:
        return main_block(args)
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
