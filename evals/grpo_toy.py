"""A self-contained FP8 GRPO run: a tiny Llama learns to answer a digit string with its last digit.

The script builds everything it needs in --workdir: a character tokenizer, a small Llama pre-trained for a few
seconds on prompts followed mostly by random digits (a quarter of the examples show the rule), the model
converted to per-channel FP8 by fp8-convert, then GRPO with LoRA on the frozen FP8 weights. The reward is the
fraction of the first six answer characters that equal the prompt's last digit, so it starts near 0.3 and
rises only if RL works. One JSON line per step on stdout.

    python evals/grpo_toy.py --steps 40 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIGITS = "0123456789"
PROMPT_DIGITS, ANSWER = 6, 6
COPY_SHARE = 0.25  # pre-training examples that follow the rule
LORA_RANK = 8


def prompt_text(rng: random.Random) -> str:
    return "".join(rng.choice(DIGITS) for _ in range(PROMPT_DIGITS)) + "="


def last_digit_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Fraction of the first six answer characters equal to the prompt's last digit, in [0, 1]."""
    return [sum(ch == p[-2] for ch in c[:ANSWER]) / ANSWER for p, c in zip(prompts, completions)]


def make_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *DIGITS, "="])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)
    return fast


def pretrain(directory: Path, seed: int, steps: int = 300) -> Path:
    """A small Llama that writes six digits and </s> after '=': mostly random, a quarter following the rule."""
    import torch
    import transformers

    if (directory / "config.json").exists():
        return directory
    import shutil

    from fp8kit.rl.grpo import prompt_token_ids

    final, directory = directory, directory.with_name(directory.name + ".partial")
    shutil.rmtree(directory, ignore_errors=True)  # built aside and renamed: a killed run leaves no half model
    tokenizer = make_tokenizer(directory)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = []
        for _ in range(64):
            p = prompt_text(rng)
            answer = p[-2] * ANSWER if rng.random() < COPY_SHARE else "".join(rng.choice(DIGITS) for _ in range(ANSWER))
            # the prompt tokenized as train() will tokenize it (its BOS included), the answer after it as is
            rows.append(prompt_token_ids(tokenizer, p)
                        + tokenizer(answer + "</s>", add_special_tokens=False)["input_ids"])
        ids = torch.tensor(rows)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    from fp8kit.quality import quiet

    with quiet():
        model.to(torch.bfloat16).save_pretrained(directory)
    directory.rename(final)
    return final


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="an FP8 or BF16 checkpoint to train instead of the built toy model")
    ap.add_argument("--vllm", action="store_true", help="rollouts in vLLM sharing the weights (CUDA)")
    ap.add_argument("--bf16", action="store_true", help="the BF16 baseline instead of FP8")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--loss-type", default="grpo")
    ap.add_argument("--workdir", default=None, help="where the toy model is built (default: a temp folder)")
    ap.add_argument("--output-dir", help="write checkpoints here every --save-steps")
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="the trainer's decoder layers compiled (torch_compile)")
    ap.add_argument("--resume", help="a checkpoint folder to resume from")
    args = ap.parse_args()

    from fp8kit.errors import Fp8kitError

    try:
        run(args)
    except Fp8kitError as e:  # bad arguments and inputs: one line, as fp8kit's commands
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def run(args):
    import tempfile

    import torch

    from fp8kit import convert
    from fp8kit.errors import Fp8kitError
    from fp8kit.rl.grpo import GRPOConfig, resume_checkpoint, train
    from fp8kit.rl.loader import _one_line, check_device
    from fp8kit.rl.model import load_model
    from fp8kit.rl.vllm_engine import check_rollout_arguments

    # checked before the toy model is pre-trained and converted
    config = GRPOConfig(steps=args.steps, prompts_per_step=8, num_generations=8, max_completion_length=ANSWER + 2,
                        learning_rate=5e-3, loss_type=args.loss_type, seed=args.seed, output_dir=args.output_dir,
                        save_steps=args.save_steps, torch_compile=args.compile)
    check_device(args.device)
    resume = resume_checkpoint(args.resume) if args.resume else None
    if args.vllm:  # asked for by name: never the silent fallback to transformers' generate that load_model makes
        check_rollout_arguments(getattr(torch, args.dtype), LORA_RANK)
        if args.device != "cuda":
            raise Fp8kitError("--vllm: vLLM rollouts share the weights on a CUDA GPU; pass --device cuda too")
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise Fp8kitError(f"--vllm: the vllm package does not import here ({e}); install it (pip install "
                              f"'fp8kit[gpu]') or leave --vllm out") from None
    torch.set_num_threads(max(1, torch.get_num_threads()))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-toy-"))
    try:  # a file there failed with a traceback once the toy model was built
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file, not a folder" if workdir.is_file() else _one_line(e)
        raise Fp8kitError(f"--workdir {workdir}: {why}; choose another folder") from None
    t0 = time.perf_counter()
    if args.model:
        checkpoint = Path(args.model)
    else:
        # named by the seed: the same --workdir with another --seed pre-trains (and converts) another model
        src = pretrain(workdir / f"toy-bf16-seed{args.seed}", args.seed)
        checkpoint = src
        if not args.bf16:
            checkpoint = workdir / f"toy-fp8-dynamic-seed{args.seed}"
            if not (checkpoint / "config.json").exists():
                convert(src, checkpoint, scheme="dynamic")
    prepared_s = time.perf_counter() - t0
    model, tokenizer = load_model(checkpoint, load_in_fp8=not args.bf16, dtype=getattr(torch, args.dtype),
                                  max_seq_length=32, lora_rank=LORA_RANK, lora_alpha=16, fast_inference=args.vllm,
                                  device=args.device)
    rng = random.Random(1234)
    prompts = [prompt_text(rng) for _ in range(512)]
    print(json.dumps({"event": "start", "checkpoint": str(checkpoint), "scheme": model.fp8_scheme,
                      "rollout": model.rollout_engine.name, "prepare_s": round(prepared_s, 2)}), flush=True)
    train(model, tokenizer, prompts, [last_digit_reward], config, resume_from=resume,
          on_step=lambda m: print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in m.items()}),
                                  flush=True))


if __name__ == "__main__":
    main()
