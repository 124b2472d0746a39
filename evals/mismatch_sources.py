"""How much of the FP8 rollout/trainer mismatch KL one rounding step explains, emulated on the CPU.

grpo_gpu.py measures a mismatch KL between vLLM's and the trainer's log-probabilities about 50x larger with FP8
weights than with BF16 (0.019 against 0.00036 on the TinyLlama-shaped model). Both quantize activations per token
with the same formula, so the suspect is what gets quantized: the trainer quantizes the BF16 output of
transformers' RMSNorm and of SiLU(gate) * up, while vLLM's torch.compile (Inductor) may fuse the native norm and
activation with the FP8 quantization and, with `emulate_precision_casts` off, skip the rounding to BF16 in
between. Three measurements:

- The mechanism: vLLM 0.25's native RMSNorm and per-token FP8 quantization (restated below), compiled by Inductor
  on this machine's CPU with `emulate_precision_casts` off (torch's default) and on, against eager: the share of
  FP8 codes that differ.
- The effect: one model computed two ways in float32, identical except for that step: `trainer` rounds the input
  of every FP8 projection to BF16 before quantizing it; `fused` does so only for o_proj (attention output is
  BF16 in both engines). KL(fused || trainer) over the completion positions (the direction grpo_gpu's mismatch KL
  estimates) and the share of FP8 activation codes that differ in the first layer.
- The amplification: the same two ways through the BF16 source model (float32 compute, no FP8 quantization).
  The ratio of the two KLs says how much FP8 quantization magnifies a BF16-level difference between engines.

    python evals/mismatch_sources.py [--shape tinyllama-1.1b] [--rows 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.grpo_gpu import SHAPES, WORKLOAD  # noqa: E402
from evals.results_file import write_json  # noqa: E402


FUSED_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")  # norm or SiLU*up before them


def vllm_norm_then_quant(x, weight, epsilon: float = 1e-5):
    """vLLM 0.25's `ir.ops.rms_norm` (vllm/ir/ops/layernorm.py, the "native" implementation the CUDA platform
    picks under Inductor) followed by `QuantFP8.forward_native` per token (vllm/model_executor/layers/
    quantization/input_quant_fp8.py, used with custom ops off, vLLM's default under Inductor)."""
    import torch

    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    x = (x.to(weight.dtype) * weight).to(orig_dtype)
    scale = (x.abs().max(dim=-1)[0].unsqueeze(-1).to(torch.float32) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def inductor_codes_differing(hidden: int) -> dict:
    import torch
    import torch._inductor.config as inductor_config

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, hidden, generator=g).to(torch.bfloat16)
    weight = (1 + 0.05 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    eager, _ = vllm_norm_then_quant(x, weight)
    result = {}
    for emulate in (False, True):
        torch._dynamo.reset()
        with inductor_config.patch(emulate_precision_casts=emulate):
            compiled, _ = torch.compile(vllm_norm_then_quant)(x, weight)
        differing = (compiled.view(torch.uint8) != eager.view(torch.uint8)).float().mean().item()
        result[f"emulate_precision_casts={emulate}"] = differing
    return result


def fused_and_trainer_logps(model, linear_type, ids, completion: int) -> tuple[dict, dict, dict]:
    """Completion log-probabilities with every projection input rounded to BF16 (`trainer`) and with only o_proj's
    (`fused`), the first layer's q_proj input of each, and the seconds each forward took."""
    import functools

    import torch

    rounding = {"mode": "trainer"}
    first_inputs = {}

    def round_input(name, module, inputs):
        (x,) = inputs
        if name.startswith("model.layers.0.self_attn.q_proj"):
            first_inputs[rounding["mode"]] = x.detach().clone()
        if rounding["mode"] == "trainer" or not name.endswith(FUSED_INPUTS):
            return (x.to(torch.bfloat16).to(x.dtype),)
        return None

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, linear_type) and ".layers." in name:
            hooks.append(module.register_forward_pre_hook(functools.partial(round_input, name)))
    logps, seconds = {}, {}
    with torch.no_grad():
        for mode in ("trainer", "fused"):
            rounding["mode"] = mode
            t0 = time.perf_counter()
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=completion + 1).logits[:, :-1]
            logps[mode] = torch.log_softmax(logits.double(), dim=-1)
            seconds[mode] = time.perf_counter() - t0
    for hook in hooks:
        hook.remove()
    return logps, seconds, first_inputs


def kl_stats(logps: dict) -> dict:
    """KL(fused || trainer) per completion position (the direction grpo_gpu's mismatch KL estimates), summarized."""
    fused, trainer = logps["fused"], logps["trainer"]
    kl = (fused.exp() * (fused - trainer)).sum(-1)
    return {"kl_fused_vs_trainer_mean": kl.mean().item(), "kl_fused_vs_trainer_median": kl.median().item(),
            "kl_fused_vs_trainer_max": kl.max().item(),
            "top1_agreement": (fused.argmax(-1) == trainer.argmax(-1)).double().mean().item()}


def build(workdir: Path, shape: str) -> tuple[Path, Path]:
    """(BF16 source, its fp8-convert dynamic conversion), made once in workdir."""
    from fp8kit import convert
    from fp8kit.models import build_checkpoint

    src, out = workdir / f"{shape}-bf16", workdir / f"{shape}-fp8-dynamic"
    if not (src / "config.json").exists():
        build_checkpoint(src, "llama", **SHAPES[shape])
    if not (out / "config.json").exists():
        convert(src, out, scheme="dynamic")
    return src, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/mismatch-sources")
    ap.add_argument("--out", default=str(ROOT / "evals/results/mismatch_sources.json"))
    args = ap.parse_args()

    import torch
    import transformers

    from fp8kit.rl.fp8_linear import FP8LoRALinear, quantize_activation
    from fp8kit.rl.loader import load_fp8_model

    inductor = inductor_codes_differing(SHAPES[args.shape]["hidden_size"])
    print("Inductor against eager, share of FP8 codes differing:", json.dumps(inductor), flush=True)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    source_dir, checkpoint = build(workdir, args.shape)
    model = load_fp8_model(checkpoint, torch.float32, lora_rank=8)  # LoRA B starts at zero: no effect
    model.eval()
    prompt, completion = WORKLOAD["prompt_tokens"], WORKLOAD["max_completion_length"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPES[args.shape]["vocab_size"], (args.rows, prompt + completion), generator=g)

    logps, seconds, first_inputs = fused_and_trainer_logps(model, FP8LoRALinear, ids, completion)
    fp8 = kl_stats(logps)
    del model
    # the same rounding difference with the BF16 source weights (no FP8 quantization): how much FP8 amplifies it
    source = transformers.AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32,
                                                               use_safetensors=True)
    source.eval()
    logps_bf16, seconds_bf16, _ = fused_and_trainer_logps(source, torch.nn.Linear, ids, completion)
    bf16 = kl_stats(logps_bf16)
    q_trainer, _ = quantize_activation(first_inputs["trainer"].reshape(-1, first_inputs["trainer"].shape[-1])
                                       .to(torch.bfloat16).float(), "dynamic")
    q_fused, _ = quantize_activation(first_inputs["fused"].reshape(-1, first_inputs["fused"].shape[-1]), "dynamic")
    differing = (q_trainer.view(torch.uint8) != q_fused.view(torch.uint8)).float().mean().item()
    report = {
        "machine": {"device": "cpu", "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "command": "python evals/mismatch_sources.py " + " ".join(sys.argv[1:]),
        "model": {"shape": args.shape, **SHAPES[args.shape], "scheme": "dynamic (per-channel weights, per-token "
                  "activations), fp8-convert, random weights, float32 compute"},
        "workload": {"rows": args.rows, "prompt_tokens": prompt, "completion_tokens": completion,
                     "input": "uniform random token ids"},
        "inductor_vs_eager_fp8_codes_differing": inductor,
        **fp8,
        "layer0_qkv_input_fp8_codes_differing": differing,
        "bf16_weights": bf16,
        "fp8_amplification": fp8["kl_fused_vs_trainer_mean"] / bf16["kl_fused_vs_trainer_mean"],
        "seconds": {"fp8": seconds, "bf16_weights": seconds_bf16},
    }
    write_json(args.out, report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
