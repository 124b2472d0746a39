"""Where a compiled, checkpointed FP8 LoRA step spends the host's time: reentrant against non-reentrant checkpointing.

bench_fp8_lora measured 32 compiled FP8 layers at GRPO's micro-batch taking 305 ms a step with 194 ms of GPU time under
non-reentrant checkpointing, BF16 249 ms with 234 ms. This runs the step (the bench's model, the trainer's compiled
layers) for FP8 and BF16 non-reentrant and FP8 reentrant in one process, and prints each step's time, the tensors one
forward saves for backward, and the host's time by op (torch.profiler, CPU). Its run on an H100 is
evals/results/profile_checkpointing_h100.txt.

    python evals/profile_checkpointing.py        (GPU)
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals.bench_fp8_lora import QWEN3_8B, build  # noqa: E402
from fp8kit.rl.regional_compile import compiled_decoder_layers  # noqa: E402


def run(variant: str, checkpointing: str, layers: int = 32, batch: int = 8, seq: int = 384) -> None:
    model = build(layers, variant, 32, checkpointing)
    reentrant = checkpointing == "reentrant"
    x = torch.randn(batch, seq, QWEN3_8B["hidden_size"], device="cuda", dtype=torch.bfloat16, requires_grad=reentrant)
    packs = [0]

    def step():
        out = model(inputs_embeds=x, use_cache=False).last_hidden_state
        out.float().pow(2).mean().backward()

    def pack(t):
        packs[0] += 1
        return t

    with compiled_decoder_layers(model, enabled=True):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 4 * 1e3
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(inputs_embeds=x, use_cache=False)
        del out
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
    print(f"== {variant} checkpointing={checkpointing} step_ms={ms:.1f} packs_one_forward={packs[0]}", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70), flush=True)
    del model
    torch.cuda.empty_cache()


if __name__ == "__main__":
    run("dynamic/triton+compile", "non-reentrant")
    run("bf16+compile", "non-reentrant")
    run("dynamic/triton+compile", "reentrant")
