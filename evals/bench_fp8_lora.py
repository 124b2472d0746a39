"""LoRA training step on frozen FP8 weights against frozen BF16 weights, side by side in one run (GPU).

A stack of Qwen3-8B-shaped decoder layers (hidden 4096, MLP 12288, 32 heads, 8 KV heads, head dim 128),
LoRA rank 32 on every projection; forward + backward of a batch, tokens/s and peak memory, for BF16 (fp8kit's
LoRA layer and PEFT's forward) and for FP8 with each backend and scheme, eager and under torch.compile, with the
exact or the FP8 input gradient (fp8bwd), with the layer's default fast accumulation or float32 promotion
(f32acc), for blocks on the Triton GEMM that GPUs without cuBLAS block scaling run (tritongemm), and with
transformers' MLP instead of the fused SiLU-multiply-quantize kernel load_fp8_model gives it (unfused), and with
the exact input gradient's weight dequantized by torch's ops instead of the one-pass Triton kernel (torchdequant);
--gradient-checkpointing recomputes each decoder layer in backward, as the GRPO trainer does (non-reentrant, its
eager layers' mode and the default here, or reentrant, its compiled layers'); compiled layers are timed on a graph
for the one length --seq unless --first-seq runs the first warm-up step at another length: the layers then compile
with a dynamic length, as the GRPO trainer's do (results made with it before 2026-11-27 timed the graph dynamo
recompiled at the second length). Each FP8
row is compared with the faster BF16 row of its own mode. Backends this machine cannot run (fbgemm-gpu-genai or
torchao missing, a scheme the library or GPU lacks) get a row with the reason instead of numbers. Writes
evals/results/fp8_lora.json, rewritten after every variant so that a run cut short keeps what it measured.

    python evals/bench_fp8_lora.py [--layers 4] [--batch 4] [--seq 2048] [--budget-s 300] [--profile]
                                   [--gradient-checkpointing [non-reentrant|reentrant]] [--first-seq 320]
                                   [--variants bf16,dynamic/triton/fp8bwd+compile,...]
                                   [--out evals/results/fp8_lora.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.results_file import write_json  # noqa: E402


QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PeftStyleLoRALinear(nn.Module):
    """The `bf16-peft` baseline: frozen BF16 weight and PEFT's LoRA forward (base + B(A(x)) * scaling, three
    passes over the output), as PEFT and TRL users run it."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=linear.weight.dtype, device=linear.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x):
        return nn.functional.linear(x, self.weight) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def build(layers: int, variant: str, rank: int, checkpointing: str | None = None):
    from transformers import Qwen3Config, Qwen3Model

    from fp8kit.converter.schemes import SCHEMES, quantize_weight
    from fp8kit.rl import FP8LoRALinear
    from fp8kit.rl.bf16_lora import LoRALinear
    from fp8kit.rl.fp8_mlp import fuse_gated_mlps

    variant, compile = variant.removesuffix("+compile"), variant.endswith("+compile")
    torch.manual_seed(0)
    config = Qwen3Config(num_hidden_layers=layers, **QWEN3_8B)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen3Model(config).to(torch.bfloat16)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        parent, _, leaf = name.rpartition(".")
        if variant == "bf16":  # fp8kit's own BF16 baseline: the same LoRA code as FP8LoRALinear
            new = LoRALinear(module.weight.detach(), None, rank=rank, alpha=2 * rank, dtype=torch.bfloat16)
        elif variant == "bf16-peft":
            new = PeftStyleLoRALinear(module, rank, 2 * rank)
        else:
            scheme, backend, option = fp8_variant(variant)
            q, s = quantize_weight(module.weight.detach(), SCHEMES[scheme], torch.float32)
            new = FP8LoRALinear(q, s, scheme, rank=rank, alpha=2 * rank, dtype=torch.bfloat16, backend=backend,
                                fp8_backward="fp8bwd" in option, fast_accum=False if "f32acc" in option else None)
        setattr(model.get_submodule(parent), leaf, new)
        del module
    if not variant.startswith("bf16") and "unfused" not in fp8_variant(variant)[2]:
        fuse_gated_mlps(model)  # as load_fp8_model and load_model build FP8 models
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    if checkpointing:  # as fp8kit.rl.grpo trains (GRPOConfig.gradient_checkpointing, transformers' own)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.train()
    if compile:  # compiled in _measure as GRPOConfig(torch_compile=True) compiles the trainer's layers
        torch._dynamo.reset()  # no variant reuses (or counts against the recompile limit of) another's graphs
    torch.cuda.empty_cache()
    return model


def weight_bytes(model) -> int:
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if any(f".{p}." in f".{name}" for p in PROJECTIONS) and "lora_" not in name:
            total += t.numel() * t.element_size()
    return total


@functools.cache
def opaque_quantizer():
    """fp8kit's Triton activation quantizer as the opaque operator its compiled layers called until 2026-11-27."""
    from fp8kit.rl.fp8_linear import GROUP, MIN_SCALE
    from fp8kit.rl.triton_quant import quantize_activation_triton

    @torch.library.custom_op("fp8kit_bench::quantize_activation", mutates_args=())
    def quantize(x: torch.Tensor, scheme: str, col_scale: torch.Tensor | None = None,
                 min_scale: float = MIN_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_activation_triton(x.contiguous(), scheme, col_scale, min_scale)

    @quantize.register_fake
    def _(x, scheme, col_scale=None, min_scale=MIN_SCALE):
        M, K = x.shape
        return (x.new_empty((M, K), dtype=torch.float8_e4m3fn),
                x.new_empty((M, K // GROUP if scheme == "block" else 1), dtype=torch.float32))

    return quantize


def measure(variant: str, args) -> dict:
    from fp8kit.rl import fp8_linear

    cublas_block_scaling, dequantized = fp8_linear.cublas_block_scaling, fp8_linear._dequantized
    fused_quantizer = fp8_linear._fused_quantizer
    options = set() if variant.startswith("bf16") else fp8_variant(variant)[2]
    if "tritongemm" in options:
        fp8_linear.cublas_block_scaling = lambda device: False
    if "torchdequant" in options:
        fp8_linear._dequantized = lambda weight, scale, scheme, dtype, backend: fp8_linear.dequantize_weight(
            weight, scale, scheme, dtype)
    if "opaquequant" in options:
        # built here, outside the compiled layers: a first version that called opaque_quantizer() inside them took
        # 785 ms a step at 32 layers x 8 x 384 against 228 ms traced (an H100 run not kept)
        opaque = opaque_quantizer()
        fp8_linear._fused_quantizer = lambda backend: opaque if torch.compiler.is_compiling() else fused_quantizer(
            backend)
    try:
        return _measure(variant, args)
    finally:
        fp8_linear.cublas_block_scaling, fp8_linear._dequantized = cublas_block_scaling, dequantized
        fp8_linear._fused_quantizer = fused_quantizer


def _measure(variant: str, args) -> dict:
    from fp8kit.rl.regional_compile import compiled_decoder_layers

    model = build(args.layers, variant, args.rank, args.gradient_checkpointing)
    weights = weight_bytes(model)

    def embeddings(seq: int) -> torch.Tensor:
        return torch.randn(args.batch, seq, QWEN3_8B["hidden_size"], device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.gradient_checkpointing is not None)  # as the trainer's embeddings hook

    x = embeddings(args.seq)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(x=x):
        out = model(inputs_embeds=x, use_cache=False).last_hidden_state
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with compiled_decoder_layers(model, enabled=variant.endswith("+compile"), dynamic_length=bool(args.first_seq)):
        t0 = time.perf_counter()
        if args.first_seq:  # a GRPO run's first width, then the timed steps at --seq on the same graph
            step(embeddings(args.first_seq))
        for _ in range(args.warmup):  # includes torch's, Triton's and torchao's first-call compilation, autotuning
            step()
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.steps
        row = {"tokens_per_s": args.batch * args.seq / seconds, "step_ms": seconds * 1e3,
               "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9, "weight_gb": weights / 1e9,
               "warmup_s": warmup_s}
        if args.profile:
            row["kernels"] = profile(step)
    del model, opt, params
    torch.cuda.empty_cache()
    return row


def profile(step, top: int = 30) -> dict:
    """GPU time of one step by kernel: {"total_ms", "top": [[name, ms, calls], ...]} (names cut at 90 chars)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            entry = times.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.device_time / 1e3
            entry[1] += 1
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])
    return {"total_ms": sum(v[0] for v in times.values()),
            "top": [[name, round(ms, 3), calls] for name, (ms, calls) in ranked[:top]]}


DEFAULT_VARIANTS = ("bf16,bf16-peft,dynamic/torch,dynamic/triton,dynamic/triton/fp8bwd,dynamic/triton/fp8bwd/unfused,"
                    "block/torch,block/triton,"
                    "block/triton/fp8bwd,tensor/triton,tensor/triton/fp8bwd,"
                    "bf16+compile,bf16-peft+compile,dynamic/triton+compile,dynamic/triton/fp8bwd+compile,"
                    "tensor/triton/fp8bwd+compile,dynamic/torch/fp8bwd+compile,dynamic/triton/fp8bwd/f32acc+compile,"
                    "dynamic/fbgemm,block/fbgemm,tensor/fbgemm,dynamic/torchao,tensor/torchao,block/torchao")


# fp8bwd: the input gradient in FP8 too; f32acc: no fast accumulation; tritongemm: block GEMMs on fp8kit's Triton
# kernel, as on GPUs where cuBLAS cannot scale blocks (L4, RTX 40/50, Blackwell), instead of cuBLAS; unfused:
# transformers' MLP forward instead of the fused SiLU-multiply-quantize kernel that load_fp8_model gives the MLPs;
# torchdequant: the exact input gradient's weight dequantized by torch's three ops, not the one-pass Triton kernel;
# opaquequant: compiled, the Triton quantization kernel called as an opaque operator (fp8kit's compiled layers until
# 2026-11-27; the compiler calls it once for an input q/k/v or gate/up share) instead of traced into the graph
OPTIONS = ("fp8bwd", "f32acc", "tritongemm", "unfused", "torchdequant", "opaquequant")


def fp8_variant(variant: str) -> tuple[str, str, set[str]]:
    """(scheme, backend, options) of an FP8 variant name such as dynamic/triton/fp8bwd+compile."""
    scheme, backend, *options = variant.removesuffix("+compile").split("/")
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise ValueError(f"variant {variant!r}: unknown option {unknown}; expected {', '.join(OPTIONS)}")
    return scheme, backend, set(options)


def unsupported(variant: str, backends: dict) -> str | None:
    """Why this machine cannot run the variant (from available_backends, or a name it cannot read), or None."""
    if variant.startswith("bf16"):
        return None
    try:
        scheme, backend, _ = fp8_variant(variant)
    except ValueError as e:
        return str(e)
    if backend not in backends:
        return f"unknown backend {backend!r}"
    entry = backends[backend]
    return None if scheme in entry["schemes"] else entry["unsupported"].get(scheme, "not supported")


def row_key(variant: str, rows: dict) -> str:
    """A variant named again (a BF16 row before and after the FP8 ones, to see the host drift) gets a row of its own,
    `variant #2`: it replaced the first one's."""
    n = 1 + sum(variant_of(k) == variant for k in rows)
    return variant if n == 1 else f"{variant} #{n}"


def variant_of(key: str) -> str:
    return key.split(" #")[0]


def summarize(rows: dict, report: dict) -> None:
    """Speedups against the faster BF16 baseline (fp8kit's LoRA or PEFT's forward) of the same mode, eager or
    compiled; the report's headline is the best FP8 row."""
    done = {k: v for k, v in rows.items() if "tokens_per_s" in v}
    for compiled in (False, True):
        mode = {k: v for k, v in done.items() if variant_of(k).endswith("+compile") == compiled}
        bf16 = [v for k, v in mode.items() if k.startswith("bf16")]
        if not bf16:
            continue
        base = max(bf16, key=lambda v: v["tokens_per_s"])
        for k, v in mode.items():
            if not k.startswith("bf16"):
                v["speedup_vs_bf16"] = v["tokens_per_s"] / base["tokens_per_s"]
                v["peak_memory_ratio_vs_bf16"] = v["peak_memory_gb"] / base["peak_memory_gb"]
                v["weight_memory_ratio"] = v["weight_gb"] / base["weight_gb"]
    fp8 = {k: v for k, v in done.items() if "speedup_vs_bf16" in v}
    if fp8:
        best = max(fp8, key=lambda k: fp8[k]["speedup_vs_bf16"])
        report.update(best_backend=best, speedup_vs_bf16=fp8[best]["speedup_vs_bf16"],
                      weight_memory_ratio=fp8[best]["weight_memory_ratio"],
                      peak_memory_ratio_vs_bf16=fp8[best]["peak_memory_ratio_vs_bf16"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="comma-separated: bf16, bf16-peft and scheme/backend[/fp8bwd][/f32acc][/tritongemm][/unfused]"
                         "[/torchdequant][/opaquequant], "
                         "each optionally +compile (fp8bwd: the input-gradient GEMM in FP8 too; f32acc: FP8 GEMMs "
                         "without fast accumulation; tritongemm: block GEMMs on fp8kit's Triton kernel, as off SM90; "
                         "unfused: transformers' MLP forward, not the fused SiLU-multiply-quantize kernel; "
                         "torchdequant: the exact input gradient's weight dequantized by torch's ops (as "
                         "compiled layers always do); opaquequant: compiled, the Triton quantization kernel called "
                         "as an opaque operator, not traced into the graph; "
                         "+compile: the decoder layers compiled as GRPOConfig(torch_compile=True) compiles them)")
    ap.add_argument("--gradient-checkpointing", nargs="?", const="non-reentrant", choices=("non-reentrant", "reentrant"),
                    help="recompute each decoder layer in backward, as the GRPO trainer does: non-reentrant "
                         "(the default; the trainer's eager layers) or reentrant (its compiled layers)")
    ap.add_argument("--first-seq", type=int, default=None,
                    help="run the first warm-up step at this sequence length: compiled, the layers then compile with a "
                         "dynamic length, as the GRPO trainer's do, and the timed steps at --seq run that graph")
    ap.add_argument("--profile", action="store_true", help="add each variant's GPU time per kernel for one step")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new variant after this many seconds (those left get a 'skipped' row)")
    ap.add_argument("--out", default=str(ROOT / "evals/results/fp8_lora.json"))
    args = ap.parse_args()
    if args.first_seq is not None and args.first_seq < 2:
        ap.error(f"--first-seq {args.first_seq}: give a length of 2 or more, or leave it out")
    import transformers
    import triton

    from fp8kit.rl import kernel_backends
    from fp8kit.rl.fp8_linear import available_backends, flag_from_env, pick_backend

    start = time.perf_counter()
    backends = available_backends("cuda")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = {}
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
                     "torchao": kernel_backends.version("torchao"),
                     "fbgemm_gpu_genai": kernel_backends.version("fbgemm"),
                     "python": platform.python_version()},
        "command": "python evals/bench_fp8_lora.py " + " ".join(sys.argv[1:]),
        # settings that change what is measured (the compiler's, the FP8 layer's) travel with the numbers
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("TORCHINDUCTOR_", "FP8KIT_"))},
        "config": {**QWEN3_8B, "layers": args.layers, "batch": args.batch, "seq": args.seq, "first_seq": args.first_seq,
                   "lora_rank": args.rank,
                   "lora_targets": list(PROJECTIONS), "optimizer": "AdamW on LoRA", "steps": args.steps,
                   "gradient_checkpointing": args.gradient_checkpointing},
        "best_backend": None, "speedup_vs_bf16": None, "weight_memory_ratio": None, "peak_memory_ratio_vs_bf16": None,
        "default_backend": pick_backend(torch.device("cuda")),
        "default_fast_accum": flag_from_env("FP8KIT_FAST_ACCUM", True, "on", "off"),
        "backends": backends,
        "results": rows,
    }

    def write():
        summarize(rows, report)
        write_json(out, report)

    for variant in args.variants.split(","):
        key = row_key(variant, rows)
        why = unsupported(variant, backends)
        if why is None and args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            why = f"time budget: --budget-s {args.budget_s:g} spent before this variant started"
        if why is not None:
            rows[key] = {"skipped": why}
        else:
            rows[key] = {"error": "unfinished: the run stopped while this variant was measured"}
            write()
            try:
                rows[key] = measure(variant, args)
            except Exception as e:  # noqa: BLE001 - a backend that fails is reported, not fatal
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                torch.cuda.empty_cache()
        write()
        print(key, rows[key], flush=True)
    report["bench_s"] = time.perf_counter() - start
    write()
    print(json.dumps({k: report[k] for k in ("best_backend", "speedup_vs_bf16", "weight_memory_ratio",
                                             "peak_memory_ratio_vs_bf16")}))


if __name__ == "__main__":
    main()
