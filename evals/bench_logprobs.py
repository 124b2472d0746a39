"""Memory and time of one GRPO micro-batch's completion log-probabilities, forward and backward, three ways.

- `trl`: the model's full logits, divided by the temperature, then TRL's selective_log_softmax (per-row
  logsumexp for float32 logits, per-row log_softmax for bf16/fp16: trl/trainer/utils.py, as GRPOTrainer's
  _get_per_token_logps uses it). The anchor.
- `full`: fp8kit before chunking: the model's full logits, then float32 gather - logsumexp.
- `chunked`: fp8kit.rl.logprobs: decoder once, then the output head over chunks of positions, each chunk's
  gradient with respect to the hidden states formed in the forward (nothing of vocabulary width kept).

The policy is a Qwen3-0.6B-shaped model (the real vocabulary, 151,936 tokens, and hidden size; --layers
decoder layers, fewer than 28 by default to keep the CPU run short: the head's share, which is what differs,
does not depend on depth) converted to FP8 (dynamic) by fp8-convert and loaded with fp8kit's FP8 LoRA layers,
gradient checkpointing on, as train() runs it. Each variant runs in its own process, a warm-up step and then
--repeats timed steps; memory is the peak above what the process held right before the step (CPU: resident
set, VmHWM reset through /proc/self/clear_refs, glibc returning freed memory at once; CUDA: torch's peak
allocated), time the median (on the CPU from a second process with glibc's default allocator). The three
variants' log-probabilities are compared too.

    python evals/bench_logprobs.py [--device cpu|cuda] [--rows 2] [--completion 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.results_file import write_json  # noqa: E402


QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)
VARIANTS = ("trl", "full", "chunked")


def trl_selective_log_softmax(logits, index):
    """TRL's selective_log_softmax (trl/trainer/utils.py), restated: the anchor's memory behaviour."""
    import torch

    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = []
    for row_logits, row_labels in zip(logits, index):
        row = torch.log_softmax(row_logits, dim=-1)
        rows.append(row.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_variant(args) -> dict:
    import torch

    from fp8kit.rl import logprobs
    from fp8kit.rl.loader import load_fp8_model, lora_modules
    from fp8kit.rl.logprobs import sampled_logprobs

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    model = load_fp8_model(args.checkpoint, dtype, lora_rank=16, device=str(device))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(std=0.01)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 151936, (args.rows, args.prompt + args.completion), generator=g).to(device)
    mask, completion = torch.ones_like(ids), ids[:, args.prompt:]
    positions = (mask.cumsum(-1) - 1)
    temperature = 0.9

    def step():
        if args.variant.startswith("chunked"):
            return logprobs.completion_logprobs(model, ids, mask, positions, completion, temperature,
                                                chunk=args.chunk)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=args.completion + 1).logits[:, :-1]
        if args.variant == "trl":
            return trl_selective_log_softmax(logits / temperature, completion)
        return sampled_logprobs(logits, completion, temperature)

    peaks, seconds, values = [], [], None
    for repeat in range(args.repeats + 1):  # the first is a warm-up: one-time buffers (oneDNN, cuBLAS) are not the step's
        for p in model.parameters():
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
            before = _rss_kib("VmRSS") * 1024
        t0 = time.perf_counter()
        out = step()
        out.float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if repeat:
            seconds.append(time.perf_counter() - t0)
            peaks.append((torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_kib("VmHWM") * 1024)
                         - before)
        values = out.detach().float().cpu()
        del out
    from safetensors.torch import save_file

    save_file({"logprobs": values}, args.values)  # compared in the parent
    grad_norm = sum(p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
    return {"peak_bytes_above_start": statistics.median(peaks), "peak_bytes_runs": peaks,
            "seconds": statistics.median(seconds), "seconds_runs": seconds, "lora_grad_norm": float(grad_norm)}


def build(workdir: Path, layers: int) -> Path:
    from fp8kit import convert
    from fp8kit.models import build_checkpoint

    out = workdir / f"qwen3-0.6b-{layers}l-fp8"
    if not (out / "config.json").exists():
        src = build_checkpoint(workdir / f"qwen3-0.6b-{layers}l", "qwen3", **QWEN3_06B, num_hidden_layers=layers)
        convert(src, out, scheme="dynamic")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench-logprobs")
    ap.add_argument("--out", default=str(ROOT / "evals/results/logprob_memory.json"))
    ap.add_argument("--chunk-sizes", default="",
                    help="also run the chunked variant with these positions per chunk (comma-separated)")
    ap.add_argument("--variant")  # internal: one variant in this process
    ap.add_argument("--chunk", type=int)  # internal: positions per chunk (default: logprobs.CHUNK_LOGITS' share)
    ap.add_argument("--checkpoint")
    ap.add_argument("--values")
    args = ap.parse_args()
    if args.variant:
        print("@@RESULT@@" + json.dumps(run_variant(args)) + "@@RESULT@@", flush=True)
        return

    import torch
    import transformers
    from safetensors.torch import load_file

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = build(workdir, args.layers)
    results, values = {}, {}
    extra_chunks = [int(c) for c in args.chunk_sizes.split(",") if c]
    for variant in VARIANTS + tuple(f"chunked-{c}" for c in extra_chunks):
        values_file = workdir / f"values-{variant}.safetensors"
        cmd = [sys.executable, __file__, "--variant", variant, "--checkpoint", str(checkpoint), "--values",
               str(values_file), *(f"--{k}={getattr(args, k)}" for k in ("device", "rows", "prompt", "completion",
                                                                          "repeats"))]
        if variant.startswith("chunked-"):
            cmd.append(f"--chunk={variant.split('-')[1]}")
        runs = {}
        # On the CPU, memory and time come from two processes. glibc keeps freed blocks below its (growing) mmap
        # threshold for reuse, which hides a later step's peak from the resident set: for memory, a fixed 64 KiB
        # threshold returns every tensor's memory to the system when it is freed; that makes every allocation
        # fault its pages in afresh, so time is taken with the default allocator.
        envs = {"memory": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "time": {}} if args.device == "cpu" else {"both": {}}
        for purpose, extra in envs.items():
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **extra})
            if proc.returncode != 0 or "@@RESULT@@" not in proc.stdout:
                sys.exit(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
            runs[purpose] = json.loads(proc.stdout.split("@@RESULT@@")[1])
        memory, timing = runs.get("memory", runs.get("both")), runs.get("time", runs.get("both"))
        results[variant] = {**{k: v for k, v in memory.items() if k.startswith("peak")},
                            **{k: v for k, v in timing.items() if k.startswith("seconds")},
                            "lora_grad_norm": memory["lora_grad_norm"]}
        values[variant] = load_file(values_file)["logprobs"]
        print(variant, json.dumps(results[variant]), flush=True)
    anchor, ours = results["trl"], results["chunked"]
    report = {
        "machine": {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "command": "python evals/bench_logprobs.py " + " ".join(sys.argv[1:]),
        "model": {"shape": "Qwen3-0.6B (random weights), FP8 dynamic via fp8-convert, LoRA rank 16 on every "
                           "projection, gradient checkpointing", **QWEN3_06B, "num_hidden_layers": args.layers},
        "workload": {"rows": args.rows, "prompt_tokens": args.prompt, "completion_tokens": args.completion,
                     "temperature": 0.9, "compute_dtype": "float32" if args.device == "cpu" else "bfloat16",
                     "repeats": args.repeats},
        "results": results,
        "memory_ratio_chunked_vs_trl": ours["peak_bytes_above_start"] / anchor["peak_bytes_above_start"],
        "memory_ratio_chunked_vs_full": ours["peak_bytes_above_start"] / results["full"]["peak_bytes_above_start"],
        "time_ratio_chunked_vs_trl": ours["seconds"] / anchor["seconds"],
        "ratios_vs_trl": {v: {"memory": r["peak_bytes_above_start"] / anchor["peak_bytes_above_start"],
                              "time": r["seconds"] / anchor["seconds"]} for v, r in results.items() if v != "trl"},
        "max_abs_logprob_difference": {f"{v}_vs_trl": float((values[v] - values["trl"]).abs().max())
                                       for v in values if v != "trl"},
    }
    write_json(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "model", "machine", "versions")}))


if __name__ == "__main__":
    main()
