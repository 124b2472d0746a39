"""FP8 against BF16 GRPO on one GPU, vLLM rollouts sharing the trainer's weights, plus a standalone vLLM engine.

For each variant (BF16 original, per-channel FP8 made by fp8-convert) a fresh process runs `load_model` with vLLM
in the process and GRPO for --steps steps on a random-weight Llama (--shape: TinyLlama-1.1B's, the issue's ~1B, or
Llama-3.1-8B's), then a second fresh process serves the same checkpoint and adapter with a standalone vLLM engine
on the same prompts and sampling settings. Building and converting run in a child as well: this process never
holds GPU memory that the device-wide peaks would count. Recorded: one copy of the weights (every base tensor of
the trainer is a view of vLLM's storage; allocated bytes against weight bytes), rollout tokens/s inside the
runtime and standalone, time in generation and training, peak GPU memory (sampled device-wide every 2 ms), the
reward curve and the rollout/trainer mismatch KL. The reward is the share of completion tokens drawn from the
lowest 1/32 of the vocabulary: a random model starts near 0.03 and LoRA can raise it.

Variants: bf16, fp8, fp8-kv8 (FP8 KV cache of the same token capacity), fp8-nocasts (vLLM's default Inductor
settings, which drop the BF16 rounding before FP8 activation quantization that the runtime keeps; see
engine_kwargs), fp8-f32acc (the trainer's FP8 GEMMs promote to float32, FP8KIT_FAST_ACCUM=0, where vLLM's do not),
fp8-fp8bwd (the trainer's input gradients are FP8 GEMMs too, FP8KIT_FP8_BACKWARD=1), fp8-block (a 128x128 block
checkpoint, load_in_fp8="block": vLLM's DeepGEMM block kernel against the trainer's block GEMMs); each takes `+mbtN` for N
tokens per vLLM forward pass, `+gpuN` for a budget of N GiB in which vLLM sizes the KV cache (every run records the
KV-cache tokens), `+fp16` for float16 in the trainer and vLLM and `+compile` for the trainer's decoder layers
compiled (split_variant). --trace-step N reports what held the memory at the peaks of step N's generation and training
(evals/memory_trace.py). One run's rollout ratio is one draw of a host whose CPU speed drifts: evals/rollout_rounds.py pools several runs (--standalone-settings runtime adds a standalone
engine with the runtime's own vLLM arguments).

    python evals/grpo_gpu.py --variants fp8,bf16 --steps 8 --out evals/results/grpo_gpu_run.json
    python evals/grpo_gpu.py --shape llama-8b --variants fp8,bf16 --steps 2 --skip-standalone
    python evals/grpo_gpu.py --shape llama-8b --variants bf16+gpu20,fp8+gpu20 --steps 2 --skip-standalone
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.process_group import run_in_group  # noqa: E402
from evals.results_file import write_json  # noqa: E402


SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                           tie_word_embeddings=False),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048,
                     tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False),
}
BASE_VARIANTS = ("bf16", "fp8", "fp8-kv8", "fp8-nocasts", "fp8-f32acc", "fp8-fp8bwd", "fp8-block")
WORKLOAD = dict(prompts_per_step=16, num_generations=8, prompt_tokens=128, max_completion_length=256)
LORA_RANK = 32
KV_CACHE_BYTES = 2 << 30
# --standalone-settings -> (where a run keeps that standalone engine's result, the ratio of the runtime's rate to it)
STANDALONE_SETTINGS = {"vllm": ("standalone", "rollout_vs_standalone_vllm"),
                       "runtime": ("standalone_runtime_settings", "rollout_vs_standalone_runtime_settings")}


def device_used() -> int:
    """Device-wide used bytes (total - free, as nvidia-smi sees them)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def torch_reserved() -> int:
    """torch's reserved bytes from the allocator's nested statistics: torch.cuda.memory_reserved() also flattens
    and sorts all of them, a few hundred Python objects per call."""
    import torch

    return torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["current"]


class PeakMemory:
    """Device-wide used memory and torch's reserved memory, sampled on a thread, with the peaks kept per phase
    ("generation", "training", or "other" around them): the difference between the two is memory outside torch's
    allocator (CUDA context, kernel images, vLLM's KV cache pool). The runtime and the standalone engine both run
    one, so the rollout rates compare like for like: the thread takes the GIL from vLLM's CPU-bound decode loop.
    Device memory is read every `interval` (one cudaMemGetInfo), torch's reserved bytes every `reserved_every`-th
    time, so a reserved peak shorter than that can go unseen (the device-wide peak, the one reported, cannot)."""

    def __init__(self, interval: float = 0.002, reserved_every: int = 10):
        self.interval, self.reserved_every, self._stop = interval, reserved_every, threading.Event()
        self.phase, self.phases = "other", {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        tick = 0
        while not self._stop.is_set():
            seen = self.phases.setdefault(self.phase, {"device_used_peak": 0, "torch_reserved_peak": 0})
            seen["device_used_peak"] = max(seen["device_used_peak"], device_used())
            if tick % self.reserved_every == 0:
                seen["torch_reserved_peak"] = max(seen["torch_reserved_peak"], torch_reserved())
            tick += 1
            time.sleep(self.interval)

    @property
    def peak(self) -> int:
        return max((p["device_used_peak"] for p in self.phases.values()), default=0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class GCPauses:
    """Seconds the cycle collector ran, and its full (oldest-generation) collections, from gc.callbacks. vLLM's
    decode loop is Python, and a collection holds the interpreter: a full one walks every tracked object that is not
    frozen, and vLLM freezes only its own startup heap (vllm/utils/gc_utils.py freeze_gc_heap, called when the engine
    is built), so in the runtime the trainer's objects, made after that, are walked during rollouts as well. Measured
    on H100s (results/grpo_gpu_rounds.json): one full collection per generation in both, 37-55 ms of collector time
    in the runtime against 50-70 ms standalone; 9.4k objects not frozen at the runtime's first rollout."""

    def __init__(self):
        self.seconds, self.full, self._t0 = 0.0, 0, None

    def _callback(self, phase: str, info: dict):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2
            self._t0 = None

    def mark(self) -> tuple[float, int]:
        return self.seconds, self.full

    def since(self, mark: tuple[float, int]) -> dict:
        return {"gc_s": self.seconds - mark[0], "gc_full_collections": self.full - mark[1]}

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def gc_heap() -> dict:
    """Objects the collector tracks (walked by a full collection) and those frozen (skipped)."""
    return {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}


class PhaseRollout:
    """The runtime's rollout engine, telling PeakMemory which phase of a GRPO step is running: generation from
    generate() until it returns, training from sleep() (KV cache released) until wake(). With trace_step, that
    step's generation and training each record torch's allocation trace (evals/memory_trace.py) into .traces."""

    def __init__(self, engine, peak: PeakMemory, pauses: GCPauses, trace_step: int | None = None):
        self.engine, self.peak, self.pauses, self.name, self.asleep_memory = engine, peak, pauses, engine.name, None
        self.trace_step, self.step, self.traces, self._training = trace_step, 0, {}, None
        self.wake_s = []  # per step: what waking took inside the generation window
        self.sleep_s = []  # per step: what releasing the KV cache for training took
        self.gc = []  # per step: the collector's time and full collections inside the generation window
        self.heap = None  # gc_heap() before the first generation

    def _window(self):
        from evals.memory_trace import Window

        return Window() if self.step == self.trace_step else None

    def generate(self, *args, **kwargs):
        self.step += 1
        if self.heap is None:
            self.heap = gc_heap()
        mark = self.pauses.mark()
        self.peak.phase = "generation"
        t0 = time.perf_counter()
        self.engine.wake()  # a no-op when wake() below ran at the end of training: timed to show the window holds none
        self.wake_s.append(time.perf_counter() - t0)
        window = self._window()
        try:
            if window is None:
                return self.engine.generate(*args, **kwargs)
            with window:
                return self.engine.generate(*args, **kwargs)
        finally:
            self.peak.phase = "other"
            self.gc.append(self.pauses.since(mark))
            if window is not None:
                self.traces["generation"] = window.summary

    def sleep(self):
        t0 = time.perf_counter()
        self.engine.sleep()
        self.sleep_s.append(time.perf_counter() - t0)
        if self.asleep_memory is None:
            self.asleep_memory = memory_snapshot()
        self.peak.phase = "training"
        self._training = self._window()
        if self._training is not None:
            self._training.__enter__()

    def wake(self):
        if self._training is not None:
            self._training.__exit__(None, None, None)
            self.traces["training"], self._training = self._training.summary, None
        self.peak.phase = "other"
        self.engine.wake()

    def sync_lora(self, model):
        self.engine.sync_lora(model)


def memory_snapshot() -> dict:
    import torch

    torch.cuda.synchronize()
    return {"device_used": device_used(), "torch_reserved": torch.cuda.memory_reserved(),
            "torch_allocated": torch.cuda.memory_allocated()}


def host() -> dict:
    """Which machine: lent GPUs of one kind sit on hosts whose CPUs differ, and a small model's decode loop is bound
    by the CPU (evals/rollout_rounds.py)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"name": platform.node(), "cpu": cpu, "cpus": os.cpu_count()}


def build(workdir: Path, shape: str) -> Path:
    import torch

    from fp8kit.models import add_tokenizer, build_checkpoint

    src = workdir / f"{shape}-bf16"
    if (src / "config.json").exists():
        return src
    build_checkpoint(src, "llama", torch.bfloat16, seed=0, device="cuda", **SHAPES[shape],
                     bos_token_id=1, eos_token_id=2)
    torch.cuda.empty_cache()
    add_tokenizer(src, (ROOT / "fp8kit/data/sample.txt").read_text() * 4, vocab_size=2048)
    return src


def prepare(args) -> dict:
    import torch

    from fp8kit import convert

    workdir = Path(args.workdir)
    src = build(workdir, args.shape)
    result = {"gpu": torch.cuda.get_device_name(0), "bf16": str(src)}
    for wanted, scheme in (("fp8", "dynamic"), ("fp8-block", "block")):
        if wanted in (args.checkpoint or "").split(","):
            fp8 = workdir / f"{args.shape}-fp8-{scheme}"
            if not (fp8 / "config.json").exists():
                convert(src, fp8, scheme=scheme, device="cuda")
            result[wanted] = str(fp8)
    return result


def prompts_for(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def low_token_reward(vocab: int):
    def low_token_share(prompts, completions, completion_ids, **_):
        return [sum(t < vocab // 32 for t in ids) / max(1, len(ids)) for ids in completion_ids]

    return low_token_share


class TokenPrompts:
    """A tokenizer stand-in for prompts that are token ids already; the reward reads completion ids, not text."""

    def __init__(self, tokenizer, table: dict[str, list[int]]):
        self.table = table
        self.pad_token_id, self.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    def __call__(self, text):
        return {"input_ids": self.table[text]}

    def batch_decode(self, ids, **kw):
        return [""] * len(ids)


VARIANT_OPTIONS = ("+mbtN (tokens per vLLM forward pass, e.g. +mbt2048), +gpuN (a budget of N GiB, e.g. +gpu20), "
                   "+fp16 (trainer and vLLM in float16), +compile (the trainer's decoder layers compiled)")


def split_variant(variant: str) -> tuple[str, dict]:
    """'fp8-kv8+mbt2048' -> ('fp8-kv8', {'max_num_batched_tokens': 2048}): a base variant and engine settings on
    top of it. `+mbtN` sets the tokens vLLM runs in one forward pass (prefill is chunked to it), which bounds the
    activation memory of a generation: the runtime's default is 2048 (ROLLOUT_MAX_BATCHED_TOKENS), vLLM's own for
    its LLM class on an 80 GB GPU 16384 (`+mbt16384`). `+gpuN` gives vLLM N GiB (gpu_memory_utilization) and lets
    it size the KV cache from what its profiling run leaves, instead of the fixed KV_CACHE_BYTES: the KV tokens
    that fit in the same budget are the context an FP8 model gains over BF16. `+fp16` runs the trainer and vLLM in
    float16 (the bfloat16 checkpoint is cast on load), which narrows the rollout/trainer mismatch. `+compile` compiles
    the trainer's decoder layers (GRPOConfig.torch_compile; the first step includes compiling)."""
    base, *extras = variant.split("+")
    if base not in BASE_VARIANTS:
        raise SystemExit(f"variant {variant!r}: unknown; known: {', '.join(BASE_VARIANTS)}, each with options "
                         f"{VARIANT_OPTIONS}")
    settings = {}
    for extra in extras:
        if extra.startswith("mbt") and extra[3:].isdigit():
            settings["max_num_batched_tokens"] = int(extra[3:])
        elif extra.startswith("gpu") and extra[3:].isdigit() and int(extra[3:]) > 0:
            settings["budget_gib"] = int(extra[3:])
        elif extra == "fp16":
            settings["dtype"] = "float16"
        elif extra == "compile":
            settings["torch_compile"] = True
        else:
            raise SystemExit(f"variant {variant!r}: unknown option {extra!r} (known: {VARIANT_OPTIONS})")
    return base, settings


def engine_kwargs(variant: str) -> dict:
    """vLLM settings per variant. The same KV-cache token capacity for every variant: an FP8 KV cache needs half
    the bytes; under a budget (+gpuN) vLLM sizes it instead, see memory_utilization. `fp8-nocasts` compiles with
    vLLM's default settings (`compilation_config={}`), where Inductor drops the BF16 rounding between vLLM's native
    RMSNorm (or SiLU-and-mul) and its FP8 activation quantization, which the runtime keeps for FP8 checkpoints
    (fp8kit.rl.vllm_engine.KEEP_PRECISION_CASTS). Dropping it changes about 2-3% of the FP8 codes
    (evals/mismatch_sources.py); keeping it cut the mismatch KL from 0.0195 to 0.0145 on an H100
    (results/grpo_gpu_h100_casts.json)."""
    base, settings = split_variant(variant)
    budgeted = settings.pop("budget_gib", None) is not None
    settings.pop("dtype", None)  # the model's dtype, passed to LLM by the caller (variant_dtype)
    settings.pop("torch_compile", None)  # the trainer's (GRPOConfig.torch_compile)
    kv_bytes = {} if budgeted else {
        "kv_cache_memory_bytes": KV_CACHE_BYTES // 2 if base == "fp8-kv8" else KV_CACHE_BYTES}
    if base == "fp8-kv8":
        return {**kv_bytes, "kv_cache_dtype": "fp8", **settings}
    if base == "fp8-nocasts":
        return {**kv_bytes, "compilation_config": {}, **settings}
    return {**kv_bytes, **settings}


def checkpoint_of(variant: str) -> str:
    """Which prepared checkpoint a variant runs on: bf16 (the original), fp8 (dynamic) or fp8-block."""
    base = split_variant(variant)[0]
    return base if base in ("bf16", "fp8-block") else "fp8"


def variant_dtype(variant: str):
    """The trainer's and vLLM's dtype for a variant: bfloat16 unless `+fp16`."""
    import torch

    return getattr(torch, split_variant(variant)[1].get("dtype", "bfloat16"))


def memory_utilization(variant: str, total_bytes: int) -> float:
    """vLLM's gpu_memory_utilization for a variant: its +gpuN budget over the GPU's memory, else 0.5 (unused then:
    a fixed kv_cache_memory_bytes skips vLLM's sizing). vLLM counts in the budget the weights, the peak activation
    memory and the memory outside torch it saw grow while loading and profiling, and gives the KV cache the rest
    (vllm/v1/worker/gpu_worker.py, determine_available_memory); the CUDA context made before it, its CUDA graphs and
    the trainer's LoRA and optimizer state come on top, so the measured device peak is reported beside it."""
    budget = split_variant(variant)[1].get("budget_gib")
    if budget is None:
        return 0.5
    if budget * 2**30 >= total_bytes:
        raise SystemExit(f"variant {variant!r}: a budget of {budget} GiB is not below this GPU's "
                         f"{total_bytes / 2**30:.1f} GiB")
    return budget * 2**30 / total_bytes


def kv_cache_tokens(llm) -> int:
    """The tokens the engine's KV cache holds: blocks times tokens per block (one KV-cache group: Llama)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def steady_steps(steps: list[dict], trace_step: int | None) -> list[dict]:
    """The steps a rate is taken over: not the first (compiling, warming up), not the traced one (tracing slows it)."""
    return [h for h in steps[1:] if h["step"] != trace_step] or steps


def run_variant(args) -> dict:
    import torch

    from fp8kit.rl.grpo import GRPOConfig, train
    from fp8kit.rl.loader import checkpoint_mismatches, lora_modules, write_adapter
    from fp8kit.rl.model import load_model
    from fp8kit.rl.vllm_engine import storage_pointers

    checkpoint = Path(args.checkpoint)
    base, settings = split_variant(args.variant)
    if base == "fp8-f32acc":  # read by every FP8LoRALinear that load_model builds
        os.environ["FP8KIT_FAST_ACCUM"] = "0"
    if base == "fp8-fp8bwd":
        os.environ["FP8KIT_FP8_BACKWARD"] = "1"
    torch.zeros(1, device="cuda")  # the CUDA context, before anything is loaded
    snapshots = {"context_only": memory_snapshot()}
    t0 = time.perf_counter()
    model, tokenizer = load_model(checkpoint, load_in_fp8="block" if base == "fp8-block" else base != "bf16",
                                  dtype=variant_dtype(args.variant),
                                  max_seq_length=WORKLOAD["prompt_tokens"] + WORKLOAD["max_completion_length"] + 8,
                                  lora_rank=LORA_RANK,
                                  gpu_memory_utilization=memory_utilization(args.variant, torch.cuda.mem_get_info()[1]),
                                  vllm_kwargs=engine_kwargs(args.variant))
    load_s = time.perf_counter() - t0
    snapshots["loaded"] = memory_snapshot()
    torch.cuda.empty_cache()  # what of "loaded" is torch's cache left over from vLLM's profiling run
    snapshots["loaded_cache_emptied"] = memory_snapshot()
    engine = model.rollout_engine
    assert engine.name == "vllm", engine.name
    vllm_ptrs = storage_pointers(engine.vllm_model)
    vllm_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in engine.vllm_model.parameters()}.values())
    lora_ids = {id(p) for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)}
    base = [t for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if id(t) not in lora_ids and "rotary" not in n]
    not_shared = [t for t in base if t.untyped_storage().data_ptr() not in vllm_ptrs]
    differing = checkpoint_mismatches(model, checkpoint)  # the views hold the checkpoint's values, split right
    lora_bytes = sum(p.numel() * p.element_size() for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B))
    vocab = model.config.vocab_size
    table = {f"p{i}": ids for i, ids in enumerate(prompts_for(vocab, 256, WORKLOAD["prompt_tokens"]))}
    config = GRPOConfig(steps=args.steps, prompts_per_step=WORKLOAD["prompts_per_step"],
                        num_generations=WORKLOAD["num_generations"],
                        max_completion_length=WORKLOAD["max_completion_length"], learning_rate=1e-3,
                        gradient_accumulation_steps=16, seed=0,
                        torch_compile=settings.get("torch_compile", False))
    history = []
    with PeakMemory() as peak, GCPauses() as pauses:
        phased = PhaseRollout(engine, peak, pauses, args.trace_step)
        train(model, TokenPrompts(tokenizer, table), list(table), [low_token_reward(vocab)], config, rollout=phased,
              on_step=lambda m: (history.append(m), print(json.dumps(m), flush=True)))
    snapshots["first_sleep"] = phased.asleep_memory
    adapter = Path(args.workdir) / f"adapter-{args.variant}"
    shutil.rmtree(adapter, ignore_errors=True)
    adapter.mkdir(parents=True)
    write_adapter(model, adapter, str(checkpoint))
    steady = steady_steps(history, args.trace_step)
    return {
        "checkpoint": str(checkpoint), "scheme": model.fp8_scheme, "load_s": load_s,
        "weights": {"vllm_weight_bytes": vllm_bytes, "trainer_base_tensors": len(base),
                    "trainer_base_tensors_not_vllm_storage": len(not_shared),
                    "trainer_tensors_differing_from_checkpoint": differing,
                    "trainer_lora_bytes": lora_bytes,
                    "trainer_allocated_bytes": engine.trainer_allocated_bytes},
        "kv_cache_tokens": kv_cache_tokens(engine.llm), "peak_device_memory_bytes": peak.peak,
        "memory_by_phase": peak.phases, "memory_snapshots": snapshots,
        "peak_torch_allocated_bytes": max(h["peak_gpu_memory_bytes"] for h in history),
        "rollout_tokens_per_s": statistics.median(h["rollout_tokens_per_s"] for h in steady),
        "generation_s": sum(h["generation_s"] for h in steady), "training_s": sum(h["training_s"] for h in steady),
        "reward_curve": [h["reward_mean"] for h in history], "mismatch_kl": [h["mismatch_kl"] for h in history],
        "wake_s": phased.wake_s, "sleep_s": phased.sleep_s, "gc_heap": phased.heap, "gc_in_generation": phased.gc, "steps": history, "adapter": str(adapter),
        **({"memory_trace": {"step": args.trace_step, **phased.traces}} if args.trace_step else {}),
    }


def run_standalone(args) -> dict:
    """The same checkpoint, adapter and sampling as one GRPO step, in a plain vLLM engine: with vLLM's settings, or
    with --standalone-settings runtime the runtime engine's own (rollout_llm_kwargs, rollout_sampling_params: sleep
    mode, processed log-probabilities, LoRA on the projections only, a seed per prompt), which tells a cost of those
    settings from a cost of sharing the process with the trainer."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from transformers import AutoConfig

    from fp8kit.rl.vllm_engine import rollout_engine_kwargs, rollout_llm_kwargs, rollout_sampling_params

    config = AutoConfig.from_pretrained(args.checkpoint)
    vocab = config.vocab_size
    max_len = WORKLOAD["prompt_tokens"] + WORKLOAD["max_completion_length"] + 8
    utilization = memory_utilization(args.variant, torch.cuda.mem_get_info()[1])
    n, max_tokens = WORKLOAD["num_generations"], WORKLOAD["max_completion_length"]
    if args.standalone_settings == "runtime":
        llm = LLM(args.checkpoint, **rollout_llm_kwargs(args.checkpoint, variant_dtype(args.variant), max_len, utilization, LORA_RANK,
                                                        None, engine_kwargs(args.variant)))

        def sampling(picked, step):
            return rollout_sampling_params(len(picked), n, max_tokens, 1.0, 1.0, step)
    else:
        # the settings the runtime's engine gets for this checkpoint (the compile settings included)
        kwargs = rollout_engine_kwargs(getattr(config, "quantization_config", None) or {}, engine_kwargs(args.variant))
        llm = LLM(args.checkpoint, dtype=str(variant_dtype(args.variant)).removeprefix("torch."), enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1,
                  max_model_len=max_len, gpu_memory_utilization=utilization, seed=0, **kwargs)

        def sampling(picked, step):
            return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, logprobs=0, seed=step)
    lora = LoRARequest("adapter", 1, args.adapter)
    prompts = prompts_for(vocab, 256, WORKLOAD["prompt_tokens"])
    rates, collected = [], []
    heap = gc_heap()
    with PeakMemory() as peak, GCPauses() as pauses:  # the runtime's samplers, so that both pay for them
        peak.phase = "generation"
        for step in range(1, args.steps + 1):
            picked = random.Random(step).sample(prompts, WORKLOAD["prompts_per_step"])
            params = sampling(picked, step)
            mark = pauses.mark()
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in picked], params, lora_request=lora, use_tqdm=False)
            seconds = time.perf_counter() - t0
            collected.append(pauses.since(mark))
            rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / seconds)
    steady = rates[1:] or rates
    return {"settings": args.standalone_settings, "rollout_tokens_per_s": statistics.median(steady),
            "per_step": rates, "peak_device_memory_bytes": peak.peak, "gc_heap": heap, "gc_in_generation": collected}


def subprocess_json(argv: list[str], env: dict, timeout: float = 560) -> dict:
    t0 = time.perf_counter()
    returncode, stdout, stderr = run_in_group([sys.executable, __file__, *argv], env, timeout=timeout)
    log = stdout + stderr
    if returncode is None:
        return {"error": f"did not finish within {timeout:.0f} s", "tail": log[-3000:], "wall_s": time.perf_counter() - t0}
    if returncode != 0 or "@@RESULT@@" not in log:
        return {"error": [line for line in log.splitlines() if "Error" in line or "error" in line][-5:],
                "tail": log[-3000:], "wall_s": time.perf_counter() - t0}
    result = json.loads(log.split("@@RESULT@@")[1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def summarize(runs: dict, shape: str) -> dict:
    """The ratios the issue asks for, and the mean mismatch KL of every variant, for one model shape."""
    fp8, bf16 = runs.get(f"{shape}/fp8", {}), runs.get(f"{shape}/bf16", {})
    kv8 = runs.get(f"{shape}/fp8-kv8", {})
    summary = {}
    if "peak_device_memory_bytes" in kv8 and "peak_device_memory_bytes" in bf16:
        summary["peak_memory_ratio_fp8_kv8_vs_bf16"] = kv8["peak_device_memory_bytes"] / bf16["peak_device_memory_bytes"]
    if "peak_device_memory_bytes" in fp8 and "peak_device_memory_bytes" in bf16:
        summary["peak_memory_ratio_fp8_vs_bf16"] = fp8["peak_device_memory_bytes"] / bf16["peak_device_memory_bytes"]
        summary["peak_torch_allocated_ratio_fp8_vs_bf16"] = (fp8["peak_torch_allocated_bytes"]
                                                             / bf16["peak_torch_allocated_bytes"])
    for _, ratio in STANDALONE_SETTINGS.values():
        if ratio in fp8:
            summary[ratio] = fp8[ratio]
    by_options, kv_tokens = {}, {}  # every FP8 variant against the bf16 run with the same engine options
    for key, run in runs.items():
        if not key.startswith(f"{shape}/fp8") or "peak_device_memory_bytes" not in run:
            continue
        name = key.split("/", 1)[1]
        options = name.partition("+")[2]
        baseline = runs.get(f"{shape}/bf16" + (f"+{options}" if options else ""), {})
        # read, not validated: a results file may hold variants of older names (fp8-casts)
        if any(o.startswith("gpu") for o in options.split("+")):  # both fill the budget: compare the KV tokens
            if baseline.get("kv_cache_tokens"):
                kv_tokens[name] = run["kv_cache_tokens"] / baseline["kv_cache_tokens"]
        elif "peak_device_memory_bytes" in baseline:
            by_options[name] = run["peak_device_memory_bytes"] / baseline["peak_device_memory_bytes"]
    if by_options:
        summary["peak_memory_ratio_vs_bf16_same_options"] = by_options
    if kv_tokens:  # under one budget (+gpuN): the context the rollouts gain
        summary["kv_cache_tokens_ratio_vs_bf16_same_budget"] = kv_tokens
    summary["mismatch_kl_mean"] = {key.split("/", 1)[1]: sum(run["mismatch_kl"]) / len(run["mismatch_kl"])
                                   for key, run in runs.items() if key.startswith(f"{shape}/") and run.get("mismatch_kl")}
    return summary


def refuse_pooled_headline(out: Path) -> None:
    """A run's summary replaces the top-level ratios of a ~1B results file: written into a headline whose rollout
    ratio rollout_rounds.py pooled over rounds (evals/results/grpo_gpu.json), one round's ratio would stand under the
    pooled one's description."""
    try:
        pooled = "rollout_vs_standalone_vllm_from" in json.loads(out.read_text())
    except (OSError, ValueError):
        return
    if pooled:
        raise SystemExit(f"{out}: a headline pooled by evals/rollout_rounds.py (rollout_vs_standalone_vllm_from); "
                         f"write this run to another --out and pool it with rollout_rounds.py --headline {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="fp8,fp8-kv8,bf16")
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/grpo-gpu")
    ap.add_argument("--out", default=str(ROOT / "evals/results/grpo_gpu_run.json"),
                    help="results file (runs already in it are kept); not a headline pooled by rollout_rounds.py")
    ap.add_argument("--skip-standalone", action="store_true")
    ap.add_argument("--child-timeout", type=float, default=560, help="seconds for each child process")
    ap.add_argument("--trace-step", type=int, help="record torch's allocation trace in this step's generation and "
                    "training and report what holds the memory at each one's peak (the step's timings are dropped "
                    "from the rates)")
    ap.add_argument("--standalone-only", action="store_true", help="add the standalone engine to earlier runs")
    ap.add_argument("--standalone-settings", choices=list(STANDALONE_SETTINGS), default="vllm",
                    help="the standalone engine's settings: vLLM's defaults (the headline ratio) or the runtime "
                    "engine's own (recorded beside it as standalone_runtime_settings)")
    ap.add_argument("--variant")  # internal: one runtime run
    ap.add_argument("--checkpoint")
    ap.add_argument("--standalone", action="store_true")  # internal
    ap.add_argument("--prepare", action="store_true")  # internal: build (and convert) the checkpoints
    ap.add_argument("--adapter")
    args = ap.parse_args()
    if args.variant:
        result = (prepare(args) if args.prepare else run_standalone(args) if args.standalone
                  else run_variant(args))
        print("@@RESULT@@" + json.dumps(result) + "@@RESULT@@", flush=True)
        return

    from importlib.metadata import version

    # this process never touches the GPU: the device-wide peaks measured in the children must not include a
    # CUDA context of ours, so building and converting run in a child too
    for variant in args.variants.split(","):
        split_variant(variant)  # an unknown name stops the run before anything is built
    refuse_pooled_headline(Path(args.out))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    # the checkpoints the variants run on: fp8 (dynamic) for every FP8 variant but fp8-block
    wanted = sorted({checkpoint_of(v) for v in args.variants.split(",")} - {"bf16"})
    prepared = subprocess_json(["--prepare", "--variant", "prepare", "--shape", args.shape, "--workdir", str(workdir)]
                               + (["--checkpoint", ",".join(wanted)] if wanted else []), env, args.child_timeout)
    if "error" in prepared:
        raise SystemExit(f"building the {args.shape} checkpoints failed: {prepared}")
    src = Path(prepared["bf16"])
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report.update({"gpu": prepared["gpu"], "vllm": version("vllm"), "torch": version("torch"),
                   "python": platform.python_version(), "host": host(),
                   "workload": {**WORKLOAD, "lora_rank": LORA_RANK, "kv_cache_bytes": KV_CACHE_BYTES}})
    report.setdefault("models", {})[args.shape] = SHAPES[args.shape]
    report.setdefault("commands", []).append("python evals/grpo_gpu.py " + " ".join(sys.argv[1:]))
    runs = report.setdefault("runs", {})
    for variant in args.variants.split(","):
        checkpoint = Path(prepared[checkpoint_of(variant)]) if variant.startswith("fp8") else src
        if args.standalone_only:
            run = runs[f"{args.shape}/{variant}"]
        else:
            run = subprocess_json(["--variant", variant, "--checkpoint", str(checkpoint), "--steps", str(args.steps),
                                   "--workdir", str(workdir)]
                                  + (["--trace-step", str(args.trace_step)] if args.trace_step else []),
                                  env, args.child_timeout)
        if "adapter" in run and not args.skip_standalone:
            key, ratio = STANDALONE_SETTINGS[args.standalone_settings]
            run[key] = subprocess_json(["--variant", variant, "--standalone", "--checkpoint", str(checkpoint),
                                        "--adapter", run["adapter"], "--steps", str(args.steps), "--workdir",
                                        str(workdir), "--standalone-settings", args.standalone_settings],
                                       env, args.child_timeout)
            if "rollout_tokens_per_s" in run[key]:
                run[ratio] = run["rollout_tokens_per_s"] / run[key]["rollout_tokens_per_s"]
        runs[f"{args.shape}/{variant}"] = run
        print(variant, json.dumps({k: v for k, v in run.items() if k != "steps"})[:3000], flush=True)
        write_json(out, report)
    summary = summarize(runs, args.shape)
    report.setdefault("summary", {})[args.shape] = summary
    if args.shape == "tinyllama-1.1b":  # the issue's ~1B model: its ratios are the headline keys
        report.update(summary)
    write_json(out, report)


if __name__ == "__main__":
    main()
