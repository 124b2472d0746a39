"""Rollouts with transformers' generate on the training model itself: the engine where vLLM is absent (CPU,
CI) or not wanted (`fast_inference=False`). It answers the same calls as the vLLM engine (generate with the
sampled tokens' log-probabilities, sync_lora, sleep, wake), so the GRPO loop does not know which it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fp8kit.rl.logprobs import sampled_logprobs


# what the GRPO loop calls on an engine (train() checks a rollout= it is given for them)
ROLLOUT_METHODS = ("generate", "sync_lora", "sleep", "wake")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the distribution sampled from: logits / temperature,
    # renormalized over the top-p nucleus (vLLM's processed_logprobs)


class _SampledTokenLogprobs:
    """A logits processor that keeps only the sampled tokens' log-probabilities: generate's output_logits would
    hold [rows, steps, vocabulary] float32 logits (10 GB for 16 x 1,024 tokens of Qwen3's vocabulary), this holds
    one step's. Custom processors run before generate's temperature and top-p warpers (transformers'
    _get_logits_processor), and HFRollout.generate configures no other processor, so `scores` are the raw
    logits that output_logits would have kept; each step's distribution is read at the next call, once the
    token sampled from it is the last of input_ids."""

    def __init__(self, temperature: float, top_p: float = 1.0):
        self.temperature, self.top_p, self.last, self.values = temperature, top_p, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.last = scores.clone()  # the warpers after this processor may reuse `scores`
        return scores

    def take(self, tokens: torch.Tensor) -> None:
        """The sampled tokens' log-probabilities, once they are known: what the trainer computes (sampled_logprobs:
        float32 logits / T, under top-p over the nucleus the warper sampled from, by the same rule)."""
        if self.last is not None:
            self.values.append(sampled_logprobs(self.last, tokens, self.temperature, self.top_p))
            self.last = None


class HFRollout:
    """transformers' generate on the training model: same weights, same FP8 numerics as training."""

    name = "transformers"

    def __init__(self, model: nn.Module, tokenizer):
        self.model = model
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # vLLM stops at the tokenizer's EOS and at every eos_token_id of the checkpoint's generation_config.json
        # (Gemma 3's <end_of_turn>, Llama 3 Instruct's <|eot_id|>; vllm/sampling_params.py
        # update_from_generation_config); sampling the same way needs the same stops
        listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
        self.eos_ids = sorted({i for i in [tokenizer.eos_token_id, *listed] if i is not None})

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0) -> list[Completion]:
        """n completions per prompt, prompt-major; each stops after an EOS token (kept) or at max_tokens."""
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(self.model.parameters()).device
        rows = [p for p in prompt_ids for _ in range(n)]
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding: every row's next token lands in the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                  max_new_tokens=max_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_ids)
        recorder = _SampledTokenLogprobs(temperature, top_p)
        was_training, saved = self.model.training, self.model.generation_config
        # generate fills what `config` leaves unset from model.generation_config (transformers 5.17
        # _prepare_generation_config): the checkpoint's repetition penalty, min_p or suppressed tokens would change
        # the logits the recorder sees and the distribution sampled from, so a default one stands in meanwhile
        self.model.generation_config = GenerationConfig()
        self.model.eval()
        # sampled from `seed` in forked generators: the caller's random stream stays where it was (it was reset to
        # a function of the run's seed every step)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                sequences = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                                generation_config=config,
                                                logits_processor=LogitsProcessorList([recorder]))
        finally:
            self.model.generation_config = saved
            self.model.train(was_training)
        new = sequences[:, width:]
        recorder.take(new[:, -1])
        logps = torch.stack(recorder.values, dim=1)[:, : new.shape[1]]
        completions = []
        stops = set(self.eos_ids)
        for row, lp in zip(new.tolist(), logps.tolist()):
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            completions.append(Completion(row[:end], lp[:end]))
        return completions

    def sync_lora(self, model: nn.Module) -> None:
        """Nothing to do: generation runs on the training model's own LoRA parameters."""

    def sleep(self) -> None:
        """Nothing to release: generate keeps no cache between calls."""

    def wake(self) -> None:
        pass
