"""How much of a vLLM engine's GPU memory `fp8kit.rl.unload_model` gives back in the process, what holds the rest,
and whether a second engine then starts in the same process.

vLLM serves one engine per process at a time: its worker asserts that its sleep-mode pool (CuMemAllocator) is empty
when the weights load. An engine shut down by unload_model had left 32 MiB in that pool on an H100, allocated and
held by no Python object. Each variant runs in a fresh process with the allocator's history recorded (Python stacks), loads
fp8kit's tiny Llama (dynamic FP8) with vLLM rollouts, trains one GRPO step, unloads it, and reports the pool by tag,
torch's allocated bytes and every block still allocated in the pool with the Python frames that allocated it; then
it loads the model again with vLLM and trains a step (or records the refusal).

Variants: `committed` (unload_model as it is), `no-cublas-clear` (cuBLAS's workspaces left alone at shutdown) and
`no-early-init` (nothing of vllm_engine.initialize_early: FlashInfer's FP4 module and DeepGEMM's runtime left for
vLLM to set up inside its weight pool), and `bf16` (the BF16 original, load_in_fp8=False, unload_model as it is).

    python evals/engine_unload.py --out evals/results/engine_unload_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.process_group import run_in_group  # noqa: E402
from evals.results_file import write_json  # noqa: E402

VARIANTS = ("committed", "no-cublas-clear", "no-early-init", "bf16")
MIB = 1 << 20


def pool_by_tag() -> dict[str, float]:
    from vllm.device_allocator.cumem import CuMemAllocator

    tags: dict[str, float] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        tags[data.tag] = tags.get(data.tag, 0) + data.handle[1] / MIB
    return tags


def pool_blocks() -> list[dict]:
    """Blocks still allocated in segments of vLLM's pool, with the innermost frames that allocated them."""
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator

    pool = set(CuMemAllocator.get_instance().pointer_to_data)
    blocks = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if segment["address"] not in pool:
            continue
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", []) if not f["filename"].startswith("<")]
            blocks.append({"segment_mib": segment["total_size"] / MIB, "mib": block["size"] / MIB,
                           "frames": frames[:12]})
    return blocks


def child(variant: str, work: Path) -> dict:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    from fp8kit import convert
    from fp8kit.converter.calibration import DEFAULT_CALIBRATION
    from fp8kit.errors import Fp8kitError
    from fp8kit.models import add_tokenizer, build_checkpoint
    from fp8kit.rl import unload_model
    from fp8kit.rl.grpo import GRPOConfig, train
    from fp8kit.rl.model import load_model

    if variant == "no-cublas-clear":
        torch._C._cuda_clearCublasWorkspaces = lambda: None
    if variant == "no-early-init":
        import fp8kit.rl.vllm_engine

        fp8kit.rl.vllm_engine.initialize_early = lambda quantized: None
    src = build_checkpoint(work / "src", "llama", torch.bfloat16, seed=0)
    add_tokenizer(src, DEFAULT_CALIBRATION.read_text(), 400)
    fp8 = convert(src, work / "fp8", scheme="dynamic").out
    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, max_completion_length=8, seed=0)
    reward = [lambda completions, **_: [len(c) % 3 / 2 for c in completions]]
    engine = {"max_seq_length": 64, "lora_rank": 8,
              "vllm_kwargs": {"kv_cache_memory_bytes": 256 * MIB, "enforce_eager": True}}
    got: dict = {}
    for load in ("first", "second"):
        try:
            model, tok = (load_model(src, load_in_fp8=False, **engine) if variant == "bf16" else
                          load_model(fp8, **engine))
        except Fp8kitError as e:
            got[f"{load}_engine"] = {"refused": str(e)}
            break
        history = train(model, tok, ["the quick", "a lazy dog"], reward, config)
        result = {"pool_after_train_mib": pool_by_tag(), "mismatch_kl": history[0]["mismatch_kl"]}
        unload_model(model)
        del model
        result.update(pool_after_unload_mib=pool_by_tag(),
                      torch_allocated_after_unload_mib=round(torch.cuda.memory_allocated() / MIB, 2),
                      pool_blocks_left=pool_blocks())
        got[f"{load}_engine"] = result
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "WORKDIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    runs = {}
    for variant in variants:
        with tempfile.TemporaryDirectory() as work:
            rc, out, err = run_in_group([sys.executable, __file__, "--out", str(args.out), "--child", variant, work],
                                        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}, timeout=900)
        lines = out.strip().splitlines()
        runs[variant] = json.loads(lines[-1]) if rc == 0 and lines else {"error": (err or out)[-3000:], "rc": rc}
        print(variant, json.dumps(runs[variant])[:2000], flush=True)
    import torch
    import vllm

    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "torch": torch.__version__,
                          "python": platform.python_version(), "command": " ".join(sys.argv),
                          "model": "fp8kit's tiny Llama (build_checkpoint 'llama', bfloat16, seed 0), fp8-convert "
                                   "--scheme dynamic; 256 MiB KV cache, eager; one GRPO step per engine",
                          "runs": runs})


if __name__ == "__main__":
    main()
