"""GRPO on a frozen (FP8 or BF16) base with LoRA: rollouts, rewards, group advantages, clipped policy loss.

One update per rollout batch (TRL's num_iterations=1), so the "old" policy is the current one detached;
what corrects the gap between the rollout engine and the trainer is truncated importance sampling with the
engine's own log-probabilities (on by default: vLLM's FP8 kernels and ours agree only up to accumulation
order). Every step's randomness (which prompts, which samples) is seeded from (seed, step), so a run resumed
from a checkpoint replays the following steps exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import math
import numbers
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.rl import logprobs
from fp8kit.rl.grpo_loss import (LOSS_TYPES, group_advantages, mismatch_kl, nanstd, policy_loss, reward_stds,
                                 truncated_importance_weights)
from fp8kit.rl.loader import (_fsync, _one_line, _rng_devices, _short_repr, adapters_disabled, check_not_unloaded,
                              load_adapter, lora_modules, write_adapter)
from fp8kit.rl.regional_compile import check_torch_compile, compiled_decoder_layers
from fp8kit.rl.rollout import ROLLOUT_METHODS, Completion, HFRollout

SCHEDULES = ("constant", "linear", "cosine")
SCALE_REWARDS = ("group", "batch", "none")
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
# GRPOConfig's numeric fields, by the check each takes (num_generations and top_p have their own)
COUNTS_FROM_ZERO = ("warmup_steps", "save_steps", "seed")
COUNTS_FROM_ONE = ("steps", "prompts_per_step", "gradient_accumulation_steps", "max_completion_length")
NUMBERS = ("temperature", "importance_sampling_cap", "max_grad_norm", "learning_rate", "beta", "weight_decay", "epsilon",
         "epsilon_high")


@dataclass
class GRPOConfig:
    steps: int = 100
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0  # < 1: engines and trainer score the nucleus-renormalized distribution (outside_nucleus)
    loss_type: str = "grpo"  # grpo | dr_grpo | dapo | gspo
    epsilon: float = 0.2
    # None: by loss_type, epsilon except dapo's clip-higher 0.28 (DAPO paper); read through effective_epsilon_high
    epsilon_high: float | None = None
    beta: float = 0.0  # KL penalty against the base model (adapters disabled)
    # as TRL: True or "group" divides advantages by the group's std, "batch" by the whole batch's (the mean stays the
    # group's), False or "none" not at all (a bool is stored as its string); None: by loss_type, "group" except
    # "none" for dr_grpo; read through effective_scale_rewards
    scale_rewards: bool | str | None = None
    importance_sampling: bool = True  # truncated IS with the rollout engine's log-probabilities
    importance_sampling_cap: float = 2.0
    learning_rate: float = 5e-5
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0  # 0: no clipping (transformers' and TRL's convention)
    gradient_accumulation_steps: int = 1  # micro-batches per step
    gradient_checkpointing: bool = True  # recompute each decoder layer in backward: activations dominate memory
    # compile each decoder layer for the trainer's passes (fp8kit.rl.regional_compile; the first steps compile): the
    # eager FP8 step at GRPO's micro-batches is bound by the host (as TRL's torch_compile, but layer by layer)
    torch_compile: bool = False
    # dropout off while training (LoRA's and the model's): the rollout sampled without it, so with it the ratios,
    # importance weights and mismatch KL would measure dropout noise instead of the policy and the engine
    disable_dropout: bool = True
    seed: int = 0
    output_dir: str | None = None
    save_steps: int = 0  # write output_dir/checkpoint-<step> every so many steps (0: never)
    reward_weights: list[float] | None = field(default=None)

    def __post_init__(self):
        # a string such as "false" is truthy: it would silently mean True
        for name in ("importance_sampling", "gradient_checkpointing", "torch_compile", "disable_dropout"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise Fp8kitError(f"{name}={value!r}: expected True or False")
        scale = self.scale_rewards
        if not (scale is None or isinstance(scale, bool) or (isinstance(scale, str) and scale in SCALE_REWARDS)):
            raise Fp8kitError(f"scale_rewards={scale!r}: expected 'group' (or True), 'batch', 'none' (or False), or "
                              f"None for 'group' ('none' with dr_grpo)")
        if not isinstance(self.loss_type, str) or self.loss_type not in LOSS_TYPES:
            raise Fp8kitError(f"loss_type {self.loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
        if not isinstance(self.lr_scheduler, str) or self.lr_scheduler not in SCHEDULES:
            raise Fp8kitError(f"lr_scheduler {self.lr_scheduler!r}: expected one of {', '.join(SCHEDULES)}")
        # numpy's integers and floats (a sweep's np.arange, a config read through pandas) count as numbers and are
        # stored as Python's, which trainer_state.json can hold
        for name in ("num_generations", *COUNTS_FROM_ZERO, *COUNTS_FROM_ONE):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        for name in ("top_p", *NUMBERS):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int)):
                setattr(self, name, float(value))
        if isinstance(self.num_generations, bool) or not isinstance(self.num_generations, int) \
                or self.num_generations < 2:
            raise Fp8kitError(f"num_generations={self.num_generations!r}: expected an integer >= 2 (advantages are "
                              f"relative to the group)")
        for name in COUNTS_FROM_ZERO:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise Fp8kitError(f"{name}={value!r}: expected an integer >= 0")
        # each of these otherwise fails only after a whole rollout, as a torch or transformers traceback
        for name in COUNTS_FROM_ONE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Fp8kitError(f"{name}={value!r}: expected an integer >= 1")
        for name in NUMBERS:
            value, zero_ok = getattr(self, name), name in ("learning_rate", "beta", "weight_decay", "epsilon_high",
                                                           "max_grad_norm")
            if value is None and name == "epsilon_high":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf \
                    or (value == 0 and not zero_ok):
                raise Fp8kitError(f"{name}={value!r}: expected a number {'>= 0' if zero_ok else '> 0'}")
        betas = self.adam_betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(not isinstance(b, bool) and isinstance(b, numbers.Real) and 0 <= b < 1 for b in betas)):
            raise Fp8kitError(f"adam_betas={betas!r}: expected two numbers in [0, 1), e.g. (0.9, 0.99)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise Fp8kitError(f"top_p={self.top_p!r}: expected a number in (0, 1]")
        weights = self.reward_weights
        if weights is not None:  # a NaN or inf weight makes every advantage NaN: each update would be skipped
            if not (isinstance(weights, (list, tuple)) and all(
                    not isinstance(w, bool) and isinstance(w, numbers.Real) and math.isfinite(w) for w in weights)):
                raise Fp8kitError(f"reward_weights={weights!r}: expected a list of finite numbers, one per reward "
                                  f"function, e.g. [1.0, 0.5]")
            self.reward_weights = [float(w) for w in weights]
        if self.output_dir is not None:  # stored as str: the checkpoint's trainer_state.json holds the config
            if not isinstance(self.output_dir, (str, os.PathLike)):
                raise Fp8kitError(f"output_dir={self.output_dir!r}: expected a folder path (str or pathlib.Path)")
            self.output_dir = os.path.expanduser(os.fspath(self.output_dir))  # '~/runs', as TrainingArguments
            check_output_dir(self.output_dir)
        if self.save_steps and not self.output_dir:
            raise Fp8kitError("save_steps needs output_dir")
        # epsilon_high and scale_rewards stay None here when unset (see the effective_ properties): resolved now, the
        # loss type's default would look like the user's choice to dataclasses.replace, which calls __init__ again
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        self.adam_betas = tuple(float(b) for b in self.adam_betas)

    @property
    def effective_epsilon_high(self) -> float:
        """The upper clip range the loss uses: epsilon_high as set, else by the current loss_type (DAPO's
        clip-higher 0.28, otherwise epsilon). Read at each use, never stored: `dataclasses.replace(config,
        loss_type="dapo")`, or setting the attribute, then gets dapo's default, and leaving dapo drops it."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return 0.28 if self.loss_type == "dapo" else self.epsilon

    @property
    def effective_scale_rewards(self) -> str:
        """How advantages are divided: scale_rewards as set ("group", "batch" or "none"; a bool assigned after
        construction is read as TRL reads it), else by the current loss_type: "none" for dr_grpo (Dr. GRPO drops
        the std division), "group" otherwise. Resolved at each use, as effective_epsilon_high."""
        if self.scale_rewards is None:
            return "none" if self.loss_type == "dr_grpo" else "group"
        if isinstance(self.scale_rewards, bool):
            return "group" if self.scale_rewards else "none"
        return self.scale_rewards


def check_output_dir(output_dir: str | os.PathLike, create: bool = False) -> None:
    """output_dir must be a folder or creatable as one: an existing file there, or a file in place of one of its
    parents, would otherwise fail only at the first checkpoint, after save_steps steps of work. `create` (train(),
    when it will save) makes it now and checks that it can be written, as transformers' Trainer makes its own."""
    path = Path(output_dir)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise Fp8kitError(f"output_dir={os.fspath(output_dir)!r}: {folder} exists and is not a folder; "
                                  f"choose another output_dir")
            break
    if not create:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise Fp8kitError(f"output_dir={os.fspath(output_dir)!r}: cannot write checkpoints there ({e.strerror or e}); "
                          f"choose another output_dir") from e


def learning_rate_at(config: GRPOConfig, step: int) -> float:
    """Linear warmup, then constant, or linear/cosine decay toward zero after the last step, step for step as
    transformers' get_scheduler (so TRL's GRPOTrainer) sets it: step is 1-based, and transformers counts from 0, so
    a warmup's first step has rate 0 and the last step still learns."""
    if step <= config.warmup_steps:
        return config.learning_rate * (step - 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return config.learning_rate
    progress = (step - 1 - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    if config.lr_scheduler == "linear":
        return config.learning_rate * max(0.0, 1.0 - progress)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31 - 1)


def _batch(prompt_ids: list[list[int]], completions: list[Completion], n: int, pad_id: int, device,
           multiple: int = 1):
    """Left-padded prompts then right-padded completions: [N, P + T] ids, attention mask, positions, plus the
    [N, T] completion ids, mask and rollout log-probabilities. P + T is rounded up to a `multiple` by padding more
    on the left, and with a `multiple` above 1 (compiled layers) a batch that would have no padding at all gets
    `multiple` columns of it: transformers passes the layers no mask for an all-ones one (sdpa's is_causal instead),
    a graph of its own that cost the compiled trainer another compile after padded batches."""
    rows = [p for p in prompt_ids for _ in range(n)]
    width, length = max(len(p) for p in rows), max(1, max(len(c.token_ids) for c in completions))
    width += -(width + length) % multiple
    if multiple > 1 and all(len(p) == width and len(c.token_ids) == length for p, c in zip(rows, completions)):
        width += multiple
    ids = torch.full((len(rows), width + length), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    rollout_logp = torch.zeros((len(rows), length))
    for i, (p, c) in enumerate(zip(rows, completions)):
        ids[i, width - len(p): width] = torch.tensor(p)
        ids[i, width: width + len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        attention[i, width - len(p): width + len(c.token_ids)] = 1
        rollout_logp[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "position_ids": positions.to(device),
            "completion_ids": ids[:, width:].to(device), "mask": attention[:, width:].float().to(device),
            "rollout_logp": rollout_logp.to(device)}


def completion_logprobs(model: nn.Module, batch: dict, rows: slice, temperature: float,
                        top_p: float = 1.0) -> torch.Tensor:
    """The trainer's log-probabilities of the completion tokens under logits / temperature (renormalized over the
    top-p nucleus, as the rollout engines report theirs), [rows, T]."""
    return logprobs.completion_logprobs(model, batch["input_ids"][rows], batch["attention_mask"][rows],
                                        batch["position_ids"][rows], batch["completion_ids"][rows], temperature,
                                        top_p=top_p)


def _config(config) -> GRPOConfig:
    if config is None:
        return GRPOConfig()
    if isinstance(config, GRPOConfig):  # checked again: fields set after it was built (num_generations = 1) skip it
        return replace(config)
    if isinstance(config, dict):
        unknown = sorted(str(k) for k in config if k not in GRPOConfig.__dataclass_fields__)
        if unknown:
            raise Fp8kitError(f"config: {unknown[0]!r} is not a GRPOConfig field")
        return GRPOConfig(**config)
    raise Fp8kitError(f"config={config!r:.60}: expected a GRPOConfig, a dict of its fields, or None for the defaults")


def is_conversation(prompt) -> bool:
    """A prompt in TRL's conversational format: a non-empty list of {"role": ..., "content": ...} messages."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """The token ids a prompt reaches both rollout engines and the trainer as: train() tokenizes prompts here
    only (its length check and every step), and the engines take these ids as they are.

    A string gets the tokenizer's special tokens (the BOS that Llama and Gemma expect before plain text) unless it
    already begins with bos_token: text made with apply_chat_template(..., tokenize=False) does (Llama 3's and Gemma
    3's templates render {{ bos_token }}), and with special tokens on it became <bos><bos>, a start the model never
    saw. TRL is no precedent to copy: its GRPOTrainer tokenized prompt text with add_special_tokens=False up to
    v0.25 (no BOS at all before a plain-text prompt on Llama) and with special tokens on since v0.26 (two BOS before
    templated text, as here before).
    A conversation (is_conversation) goes through the tokenizer's chat template with add_generation_prompt=True,
    as TRL does, and is tokenized without special tokens, as apply_chat_template(tokenize=True) does: the template
    alone decides the BOS."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        if bos and prompt.startswith(bos):
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(tokenizer(prompt)["input_ids"])  # the text alone: stand-ins (evals/grpo_gpu.py's) take no options
    if not getattr(tokenizer, "chat_template", None):
        raise Fp8kitError("a conversation needs the tokenizer's chat template, and this tokenizer has none: set "
                          "tokenizer.chat_template, or pass the prompt as text")
    try:  # the template is the model's or the user's Jinja code: a refusal (raise_exception, a bad role) is one line
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError or whatever the template's code raised
        raise Fp8kitError(f"the tokenizer's chat template failed on it ({type(e).__name__}: "
                          f"{_one_line(e)[:120]})") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _reward_value(v) -> float:
    """One reward as a float: None (no reward) is NaN; Python, numpy and 0-dim torch numbers (bools included) are
    accepted. A string such as "1.0" is refused: float() would read it, and a reward function returning text
    is a bug."""
    if v is None:
        return float("nan")
    if isinstance(v, torch.Tensor):  # one number, 0-d or [1] (a row of a [n, 1] column)
        if v.numel() == 1 and not v.is_complex():
            return float(v.reshape(()))
        raise TypeError(f"a tensor of shape {tuple(v.shape)}")
    if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
        if v.size == 1 and v.dtype.kind in "biuf":
            return float(v.reshape(()))
        raise TypeError(f"an ndarray of shape {v.shape} and dtype {v.dtype}")
    if isinstance(v, (bool, numbers.Real)) or type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):
        return float(v)
    raise TypeError(f"{type(v).__name__} {_short_repr(v, 30)}")


def _awaited(results: list) -> list:
    """The reward functions' results, those of `async def` ones (an LLM judge, a sandbox) awaited together, as TRL
    gathers them: in an event loop of their own on a worker thread, which also works where the caller's thread
    runs a loop already (Jupyter)."""
    waiting = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if not waiting:
        return results

    async def gather():
        return await asyncio.gather(*(results[i] for i in waiting))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = dict(zip(waiting, pool.submit(asyncio.run, gather()).result()))
    return [done.get(i, r) for i, r in enumerate(results)]


def _rewards(reward_funcs, weights, prompts, completions_text, completion_ids, extra) -> tuple[torch.Tensor, dict]:
    total = torch.zeros(len(completions_text))
    scored = torch.zeros(len(completions_text), dtype=torch.bool)  # by at least one function
    per_func = {}
    names = [str(getattr(func, "__name__", i)) for i, func in enumerate(reward_funcs)]
    results = [func(prompts=prompts, completions=completions_text, completion_ids=completion_ids, **extra)
               for func in reward_funcs]
    results = _awaited(results)
    for i, returned in enumerate(results):
        earlier = names[:i].count(names[i])  # two functions of one name (two lambdas): the later get _1, _2
        name = f"{names[i]}_{earlier}" if earlier else names[i]
        if isinstance(returned, torch.Tensor) and returned.dim() == 2 and returned.shape[-1] == 1:
            returned = returned[:, 0]  # a column of rewards, [n, 1]
        if returned is None or isinstance(returned, (str, bytes, dict)) or not hasattr(returned, "__iter__") \
                or isinstance(returned, torch.Tensor) and returned.dim() != 1:
            shown = (f"of shape {tuple(returned.shape)}" if isinstance(returned, torch.Tensor)
                     else _short_repr(returned, 40))  # one line, whatever the repr
            raise Fp8kitError(f"reward function {name} returned {type(returned).__name__} {shown}; expected a "
                              f"list of {total.numel()} numbers (None for no reward), one per completion")
        try:  # strings or nested lists: one line, not a torch traceback
            values = torch.tensor([_reward_value(v) for v in returned], dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise Fp8kitError(f"reward function {name} returned {type(returned).__name__} holding {e}; expected a "
                              f"list of {total.numel()} numbers (None for no reward), one per completion") from e
        if values.shape != total.shape:
            raise Fp8kitError(f"reward function {name} returned {values.numel()} values for "
                              f"{total.numel()} completions")
        if values.isinf().any():  # it would make every advantage NaN and skip the update
            raise Fp8kitError(f"reward function {name} returned {values[values.isinf()][0].item()} for completion "
                              f"{int(values.isinf().nonzero()[0])}: expected finite numbers (None for no reward)")
        per_func[f"reward/{name}"] = values.nanmean().item()
        total += (weights[i] if weights else 1.0) * values.nan_to_num(0.0)
        scored |= ~values.isnan()
    # a completion no function scored is NaN, as in TRL: group_advantages leaves it out of its group's baseline and
    # gives it advantage 0 (as a 0 it moved the baseline and was pushed down)
    return total.masked_fill(~scored, float("nan")), per_func


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, masters: dict,
                    step: int, config: GRPOConfig, scaler: torch.amp.GradScaler | None = None) -> Path:
    """The adapter in PEFT's format plus the float32 master weights and AdamW's state (safetensors, never
    pickle) and the step, written into a temporary folder and renamed: a run killed mid-save leaves the previous
    checkpoint intact."""
    from safetensors.torch import save_file

    from fp8kit.converter.output import atomic_directory

    tensors, steps = {}, {}
    for name, master in masters.items():
        tensors[f"{name}.master"] = master.detach().contiguous().cpu()
        state = optimizer.state.get(master)
        if state:
            tensors[f"{name}.exp_avg"] = state["exp_avg"].detach().contiguous().cpu()
            tensors[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().contiguous().cpu()
            steps[name] = float(state["step"])
    with atomic_directory(directory.resolve(), overwrite=True) as tmp:
        write_adapter(model, tmp)  # base_model_name_or_path: the model's name (its files fsynced)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        grad_scaler = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
        # "config" holds the fields as set (None: by loss type), so GRPOConfig(**state["config"]) behaves as the run's
        # config did whatever loss_type it is later given; "effective" records the values the run trained with
        effective = {"epsilon_high": config.effective_epsilon_high, "scale_rewards": config.effective_scale_rewards}
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "optimizer_steps": steps, "config": asdict(config),
                                                  "effective": effective,
                                                  **({"grad_scaler": grad_scaler} if grad_scaler else {})},
                                                 indent=2) + "\n")
        for name in (OPTIMIZER_FILE, STATE_FILE):  # on disk before the rename names the checkpoint (a power loss)
            _fsync(tmp / name)
    return directory


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, masters: dict,
                    scaler: torch.amp.GradScaler | None = None, config: GRPOConfig | None = None) -> int:
    """Adapter, master weights, AdamW state and float16's loss scale back in place; returns the step the checkpoint
    was written after. With the resuming run's `config`, warns of the settings that differ from the checkpoint's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = json.loads((directory / STATE_FILE).read_text())
        tensors = load_file(directory / OPTIMIZER_FILE)
        state["step"], state["optimizer_steps"]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise Fp8kitError(f"{directory}: not a readable fp8kit GRPO checkpoint ({e}); pass a checkpoint-<step> "
                          f"folder written by train()") from e
    steps = state["optimizer_steps"]
    # checked before the adapter is loaded: an edited file otherwise failed (or resumed without AdamW's state) after
    # it had replaced the model's adapter
    if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 0 \
            or not isinstance(steps, dict) or not all(isinstance(v, (int, float)) for v in steps.values()):
        raise Fp8kitError(f"{directory / STATE_FILE}: 'step' must be an integer >= 0 and 'optimizer_steps' an object "
                          f"of step counts; pass a checkpoint-<step> folder written by train()")
    load_adapter(model, directory)
    params = dict(model.named_parameters())
    for name, master in masters.items():
        if f"{name}.master" not in tensors or tensors[f"{name}.master"].shape != master.shape:
            raise Fp8kitError(f"{directory}: the checkpoint's weights for {name} do not match the model")
        with torch.no_grad():
            master.copy_(tensors[f"{name}.master"])
            params[name].copy_(master)
        if name in state["optimizer_steps"]:
            optimizer.state[master] = {"step": torch.tensor(state["optimizer_steps"][name]),
                                       "exp_avg": tensors[f"{name}.exp_avg"].to(master.device),
                                       "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(master.device)}
    if scaler is not None and scaler.is_enabled() and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])
    if config is not None:
        _warn_changed_settings(directory, state.get("config"), config)
    return int(state["step"])


# what a resumed run may change without changing the steps it replays: the length of the run (under a constant
# learning rate: linear and cosine decay over `steps`), where it writes, and whether activations are recomputed
RESUME_FREE = ("steps", "output_dir", "save_steps", "gradient_checkpointing")


def _warn_changed_settings(directory: Path, saved, config: GRPOConfig) -> None:
    """A resume with settings other than the checkpoint's run (`saved`, its trainer_state.json's "config") trains
    on, as transformers' Trainer does (compare_trainer_and_checkpoint_args), but says which differ: the steps it
    takes are then not the ones the first run would have taken. A checkpoint without a config says nothing."""
    if not isinstance(saved, dict):
        return
    now = json.loads(json.dumps(asdict(config)))  # tuples as the saved JSON has them (lists)
    free = RESUME_FREE if now["lr_scheduler"] == saved.get("lr_scheduler") == "constant" else \
        tuple(k for k in RESUME_FREE if k != "steps")
    changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if k not in free and k in saved
               and saved[k] != v]
    if changed:
        warnings.warn(f"resuming from {directory} with settings other than its run's ({'; '.join(changed)}): the "
                      f"steps from here are not the ones that run would have taken", UserWarning, stacklevel=4)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = [(int(p.name.split("-")[1]), p) for p in Path(output_dir).glob("checkpoint-*")
             if p.name.split("-")[1].isdigit() and (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def resume_checkpoint(resume_from: str | Path) -> Path:
    """The checkpoint folder a resume_from names: itself, the newest checkpoint-<step> in it, or, for
    `<output_dir>/latest`, the newest in output_dir. Callers that prepare a model first (the toy script's
    pre-training) call it early, so a wrong path fails before minutes of work."""
    if not isinstance(resume_from, (str, os.PathLike)):
        raise Fp8kitError(f"resume_from={resume_from!r:.60}: expected a checkpoint-<step> folder, an output_dir or "
                          f"<output_dir>/latest (str or pathlib.Path)")
    resume_from = Path(resume_from).expanduser()
    if (resume_from / STATE_FILE).exists():
        return resume_from
    folder = resume_from.parent if resume_from.name == "latest" else resume_from
    found = latest_checkpoint(folder) if folder.is_dir() else None
    if found is None:
        raise Fp8kitError(f"{resume_from}: no fp8kit GRPO checkpoint there (a checkpoint-<step> folder written by "
                          f"train(), or an output_dir holding some); drop resume_from to start anew")
    return found


def train(model: nn.Module, tokenizer, prompts: list, reward_funcs: list[Callable],
          config: GRPOConfig | dict | None = None, rollout=None, resume_from: str | Path | None = None,
          on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Runs config.steps GRPO steps; returns (and passes to on_step) one metrics dict per step.

    prompts: strings, conversations (lists of {"role", "content"} messages, rendered by the tokenizer's chat
    template with add_generation_prompt=True), or dicts with such a "prompt" whose other keys reach the reward
    functions as keyword arguments (TRL's conventions); prompt_token_ids says how each is tokenized. A reward
    function is called as f(prompts=, completions=, completion_ids=, **columns) and returns one float per
    completion; for conversations each completion is [{"role": "assistant", "content": text}], as in TRL.
    rollout: the engine that samples (default: transformers' generate on `model`, or the vLLM engine load_model
    attached). config: a GRPOConfig, a dict of its fields, or None for the defaults."""
    config = _config(config)
    if not isinstance(model, nn.Module):
        raise Fp8kitError(f"model={_short_repr(model, 40)}: expected the model load_model returned")
    check_not_unloaded(model, "train a model from load_model (call it again to reload this one)")
    if not callable(tokenizer):
        raise Fp8kitError(f"tokenizer={_short_repr(tokenizer, 40)}: expected the tokenizer load_model returned")
    missing = [m for m in ROLLOUT_METHODS if rollout is not None and not callable(getattr(rollout, m, None))]
    if missing:  # found after a whole rollout (sync_lora) or training step
        raise Fp8kitError(f"rollout={_short_repr(rollout, 40)}: it has no {missing[0]}(); pass an engine with "
                          f"{', '.join(m + '()' for m in ROLLOUT_METHODS)} (fp8kit.rl.rollout.HFRollout's), or leave "
                          f"rollout out")
    if config.output_dir is not None:  # it may have become a file since the config was made
        check_output_dir(config.output_dir, create=bool(config.save_steps))
    if config.torch_compile:
        check_torch_compile(model)
    if on_step is not None and not callable(on_step):  # called after the first step's rollout and update
        raise Fp8kitError(f"on_step={_short_repr(on_step, 40)}: expected a function taking each step's metrics dict")
    resume = resume_checkpoint(resume_from) if resume_from is not None else None  # before any work
    rollout = rollout or getattr(model, "rollout_engine", None) or HFRollout(model, tokenizer)
    if callable(reward_funcs):  # one function, as TRL also accepts
        reward_funcs = [reward_funcs]
    if (isinstance(reward_funcs, (str, bytes, dict)) or not hasattr(reward_funcs, "__len__") or not reward_funcs
            or not all(callable(f) for f in reward_funcs)):
        raise Fp8kitError(f"reward_funcs={_short_repr(reward_funcs, 80)}: expected a non-empty list of functions "
                          f"(prompts, completions, ...) -> one float per completion")
    if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__iter__"):  # a string: one-character prompts
        raise Fp8kitError(f"prompts={_short_repr(prompts, 60)}: expected a list of strings, conversations or dicts with "
                          f"a 'prompt'; wrap a single prompt in a list")
    if hasattr(prompts, "columns") and hasattr(prompts, "to_dict"):  # iterating a DataFrame gives its column names
        raise Fp8kitError(f"prompts: a {type(prompts).__name__} iterates over its column names; pass "
                          f"prompts.to_dict('records') (or a datasets.Dataset)")
    if config.reward_weights is not None and len(config.reward_weights) != len(reward_funcs):
        raise Fp8kitError(f"reward_weights has {len(config.reward_weights)} values for {len(reward_funcs)} reward functions")
    if is_conversation(prompts) and not any("prompt" in m for m in prompts):
        raise Fp8kitError("prompts: this is one conversation (a list of role/content messages); wrap it in a list, "
                          "or pass rows {'prompt': messages}")
    rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    if not rows or not all(isinstance(r.get("prompt"), str) or is_conversation(r.get("prompt")) for r in rows):
        raise Fp8kitError("prompts: expected a non-empty list of strings, of conversations (lists of role/content "
                          "messages) or of dicts with such a 'prompt'")
    conversational = is_conversation(rows[0]["prompt"])
    if any(is_conversation(r["prompt"]) != conversational for r in rows):
        # the reward functions get completions as text for text prompts and as messages for conversations (TRL's
        # convention): a mixed batch would hand them both
        raise Fp8kitError(f"prompts: prompt 0 is {'a conversation' if conversational else 'text'} and prompt "
                          f"{next(i for i, r in enumerate(rows) if is_conversation(r['prompt']) != conversational)} "
                          f"is not; pass all prompts as text or all as conversations")
    odd = next((k for r in rows for k in r if not isinstance(k, str)), None)
    if odd is not None:  # they reach the reward functions as keyword arguments
        raise Fp8kitError(f"prompts: a row has the key {_short_repr(odd, 40)}; column names must be strings")
    taken = sorted({k for r in rows for k in r} & {"prompts", "completions", "completion_ids"})
    if taken:  # the reward functions' own arguments
        raise Fp8kitError(f"prompts: a row has a {taken[0]!r} column, the name of an argument every reward function "
                          f"gets; rename the column")
    _check_reward_signatures(reward_funcs, sorted({k for r in rows for k in r} - {"prompt"}))
    lengths = []
    for i, r in enumerate(rows):  # one at a time, as each step does
        try:
            lengths.append(len(prompt_token_ids(tokenizer, r["prompt"])))
        except Fp8kitError as e:
            raise Fp8kitError(f"prompt {i}: {e}") from e
    if 0 in lengths:  # generate needs a last prompt token to continue from
        raise Fp8kitError(f"prompt {lengths.index(0)} tokenizes to no tokens (an empty prompt, and the tokenizer adds "
                          f"no BOS): give it some text or drop it")
    limit = getattr(model, "max_seq_length", None)
    if limit:  # vLLM refuses a prompt past max_model_len mid-run; both engines refuse it here, before any step
        longest = max(range(len(rows)), key=lengths.__getitem__)
        if lengths[longest] >= limit:
            raise Fp8kitError(f"prompt {longest} has {lengths[longest]} tokens, and max_seq_length={limit} leaves no "
                              f"room for a completion: shorten it, or load the model with a larger max_seq_length")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not trainable or not lora_modules(model):
        raise Fp8kitError("the model has no trainable LoRA parameters (load it with lora_rank > 0)")
    params = list(trainable.values())
    for p in params:  # left by the caller's own backward, or by a step that failed midway: not this run's gradients
        p.grad = None
    # AdamW steps float32 master weights: in fp16 its eps (1e-8) and small second moments underflow to zero,
    # and bf16 rounds away updates smaller than its 8-bit mantissa
    masters = {n: p if p.dtype == torch.float32 else p.detach().float().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(list(masters.values()), lr=config.learning_rate, betas=config.adam_betas,
                                  weight_decay=config.weight_decay)
    # float16 has 5 exponent bits: a GRPO loss averages over every completion token, and its gradients (1e-7 and
    # below per element) fall under float16's smallest normal (6e-5) and flush to zero. Dynamic loss scaling as
    # transformers' Trainer does for fp16 (torch.amp.GradScaler: x2^16 to start, halved on an overflow, whose step
    # is skipped); bf16 and float32 have float32's exponent range and need none.
    scaler = torch.amp.GradScaler(params[0].device.type, enabled=any(p.dtype == torch.float16 for p in params))
    start = 0
    if resume is not None:
        start = load_checkpoint(resume, model, optimizer, masters, scaler, config)
        if start >= config.steps:  # returned [] without a word: a resume that forgot to raise steps looked like a run
            warnings.warn(f"{resume} is at step {start} and steps={config.steps}: nothing left to train; pass a larger "
                          f"steps to continue the run", UserWarning, stacklevel=2)
    # the engine samples step 1 from the adapter the trainer scores with: vLLM got its copy when the model was built
    # (B zero), and an adapter loaded or set since (a warm start from SFT, load_adapter) reaches it only here
    rollout.sync_lora(model)
    checkpointing = getattr(model, "is_gradient_checkpointing", False)  # switched back afterwards, as dropout is
    # transformers' gradient_checkpointing_enable hooks the input embeddings (their output requires grad), and its
    # disable removes that hook only on PEFT models: every later forward outside no_grad built a graph, one more
    # hook a run; the hooks this run adds are removed with it
    input_hooks = list(getattr(model, "_require_grads_hooks", None) or [])
    was_training = model.training  # and the mode: load_model returns the model in eval mode, as from_pretrained
    _set_gradient_checkpointing(model, config.gradient_checkpointing, reentrant=config.torch_compile)
    dropouts = _dropouts(model) if config.disable_dropout else []
    for m, attr, _ in dropouts:
        setattr(m, attr, 0.0)
    try:
        # each step seeds torch's generators (dropout, sampling) from (seed, step), in forked ones: the caller's
        # random streams are where they were when train() returns
        with torch.random.fork_rng(devices=_rng_devices(params[0].device)):
            return _steps(model, tokenizer, rows, reward_funcs, config, rollout, optimizer, scaler, masters,
                          trainable, start, on_step)
    finally:
        for m, attr, p in dropouts:
            setattr(m, attr, p)
        if checkpointing != config.gradient_checkpointing or (checkpointing and config.torch_compile):
            _set_gradient_checkpointing(model, checkpointing)  # (compiled: back from reentrant)
        _restore_input_hooks(model, input_hooks)
        model.train(was_training)


def _restore_input_hooks(model: nn.Module, hooks: list) -> None:
    """Removes the input-embedding hooks (enable_input_require_grads') added since `hooks` were the model's."""
    now = getattr(model, "_require_grads_hooks", None) or []
    for hook in now:
        if not any(hook is h for h in hooks):
            hook.remove()
    if now:
        model._require_grads_hooks = hooks
        if hooks:
            model._require_grads_hook = hooks[0]
        elif hasattr(model, "_require_grads_hook"):
            del model._require_grads_hook


def _set_gradient_checkpointing(model: nn.Module, on: bool, reentrant: bool = False) -> None:
    """On: always re-enabled, also over a user's own enabling; non-reentrant unless `reentrant` (transformers 4.x's
    default is reentrant, which gives no gradients through frozen embeddings without an input hook).

    Reentrant for compiled layers: around them the non-reentrant checkpoint cost FP8 the compiler's gain (32
    Qwen3-8B-shaped layers, 8x384 tokens, H100, one process: FP8 359.2 ms a step non-reentrant, 227.6 ms reentrant,
    BF16 245.9 ms non-reentrant, evals/results/profile_checkpointing_h100.txt; evals/results/
    fp8_lora_h100_32layers_microbatch_gc_*.json). Eager, reentrant was faster too but held 5 GB more at its peak,
    so eager layers stay non-reentrant. Reentrant gradients reach the LoRA parameters only through an input that
    requires grad: the hook this enabling puts on the input embeddings gives that (the trainer's passes start from
    input_ids), and a model it could not hook, or did not try to, stays non-reentrant."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        return
    if on:
        hooks = getattr(model, "_require_grads_hooks", None)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        added = getattr(model, "_require_grads_hooks", None)
        if reentrant and (added is hooks or not added):  # no hook was added: none to leak
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()


def _check_reward_signatures(reward_funcs, columns: list[str]) -> None:
    """Each reward function takes the keyword arguments every step calls it with: a `def f(prompts, completions)`
    failed with a TypeError only after the first rollout. Functions whose signature Python cannot tell are called
    as they are."""
    names = ["prompts", "completions", "completion_ids", *columns]
    for i, func in enumerate(reward_funcs):
        try:
            signature = inspect.signature(func, follow_wrapped=False)  # a decorator's wrapper is what gets called
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(**dict.fromkeys(names))
        except TypeError as e:
            name = getattr(func, "__name__", f"number {i}")
            raise Fp8kitError(f"reward function {name} cannot be called as f({', '.join(n + '=' for n in names)}) "
                              f"({e}); define it as def {name if name.isidentifier() else 'reward'}(prompts, "
                              f"completions, **kwargs)") from None


def _dropouts(model: nn.Module) -> list[tuple[nn.Module, str, float]]:
    """Every dropout that acts while model.training: nn.Dropout modules, and the float rates attention layers
    apply themselves (Llama, Qwen3, Gemma3: `dropout=0.0 if not self.training else self.attention_dropout`)."""
    found = []
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p:
            found.append((m, "p", m.p))
        found += [(m, k, v) for k, v in vars(m).items()
                  if k.endswith("dropout") and isinstance(v, float) and not isinstance(m, nn.Dropout) and v]
    return found


def _add_grads_to_masters(trainable: dict, masters: dict) -> None:
    """Each micro-batch's bfloat16/float16 LoRA gradients, added into their float32 masters' gradients: summed in the
    parameters' own dtype, 8 micro-batches were 0.4% off the sum of their gradients (32: 0.7%), so accumulating
    did not equal one batch. An fp16 overflow stays inf in the master, where the loss scaler finds it."""
    for name, p in trainable.items():
        master = masters[name]
        if master is p or p.grad is None:
            continue
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad += p.grad
        p.grad = None


def _steps(model, tokenizer, rows, reward_funcs, config, rollout, optimizer, scaler, masters, trainable, start,
           on_step):
    device = next(iter(trainable.values())).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = config.num_generations
    history = []
    # every column any prompt row has, for every step (None where a row lacks it): the keys of whichever row a
    # step drew first would make a column come and go between steps
    columns = list(dict.fromkeys(k for r in rows for k in r if k != "prompt"))
    conversational = is_conversation(rows[0]["prompt"])  # train() refused a mix
    for step in range(start + 1, config.steps + 1):
        seed = _step_seed(config.seed, step)
        torch.manual_seed(seed)  # LoRA dropout's masks: a resumed run draws the ones the first run drew
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        picked = random.Random(seed).sample(rows, min(config.prompts_per_step, len(rows)))
        prompt_ids = [prompt_token_ids(tokenizer, r["prompt"]) for r in picked]

        t0 = time.perf_counter()
        completions = rollout.generate(prompt_ids, n, config.max_completion_length, config.temperature,
                                       config.top_p, seed)
        gen_s = time.perf_counter() - t0
        limit = getattr(model, "max_seq_length", None)
        if limit:  # a sequence ends at max_seq_length, as vLLM's at max_model_len
            rooms = [limit - len(p) for p in prompt_ids for _ in range(n)]
            completions = [c if len(c.token_ids) <= room else Completion(c.token_ids[:room], c.logprobs[:room])
                           for c, room in zip(completions, rooms)]
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        if conversational:  # as TRL hands completions of conversations to reward functions
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        extra = {k: [r.get(k) for r in picked for _ in range(n)] for k in columns}
        rewards, per_func = _rewards(reward_funcs, config.reward_weights, [r["prompt"] for r in picked for _ in range(n)],
                                     texts, [c.token_ids for c in completions], extra)
        advantages = group_advantages(rewards, n, scale_rewards=config.effective_scale_rewards).to(device)

        t0 = time.perf_counter()
        rollout.sleep()  # the engine's KV cache is released while the trainer needs the memory
        # compiled, widths a multiple of 8: with an attention mask Inductor's CUDA attention guards on the length's
        # alignment (L % 8, inductor/ir.py is_aligned_realized_tensor), and a width of the other kind compiled the
        # layers again (evals/results/grpo_toy_h100_compile_dynamic_length.json)
        batch = _batch(prompt_ids, completions, n, pad_id, device, multiple=8 if config.torch_compile else 1)
        lr = learning_rate_at(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        chunks = torch.arange(len(completions)).chunk(config.gradient_accumulation_steps)
        total_tokens = batch["mask"].sum().clamp_min(1).item()
        total_rows = max(1, int((batch["mask"].sum(-1) > 0).sum().item()))  # rows with completion tokens (gspo)
        stats = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "mismatch_kl": 0.0, "is_weight_mean": 0.0}
        # the decoder layers compiled for the trainer's passes only (generate's rollouts stay eager)
        with compiled_decoder_layers(model, config.torch_compile):
            for idx in chunks:
                part = slice(int(idx[0]), int(idx[-1]) + 1)
                logp = completion_logprobs(model, batch, part, config.temperature, config.top_p)
                mask, rollout_logp = batch["mask"][part], batch["rollout_logp"][part]
                ref_logp = None
                if config.beta:  # the reference is the base model, as the issue asks (a departure from TRL for an
                    # adapter warm-started from SFT: TRL's PEFT path copies the starting adapter into a frozen "ref"
                    # adapter)
                    with torch.no_grad(), adapters_disabled(model), warnings.catch_warnings():
                        # reentrant checkpointing (compiled layers) warns of each layer whose input needs no grad,
                        # under no_grad too; this pass wants none
                        warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
                        ref_logp = completion_logprobs(model, batch, part, config.temperature, config.top_p)
                is_weights = (truncated_importance_weights(logp.detach(), rollout_logp, config.importance_sampling_cap)
                              if config.importance_sampling else None)
                out = policy_loss(logp, logp.detach(), advantages[part], mask, config.loss_type, config.epsilon,
                                  config.effective_epsilon_high, config.beta, ref_logp, is_weights,
                                  config.max_completion_length)
                # each micro-batch's share of the whole batch's loss: its tokens for dapo's token-level mean, its
                # rows for the per-sequence means (grpo, gspo) and dr_grpo's fixed denominator
                share = (mask.sum().clamp_min(1).item() / total_tokens if config.loss_type == "dapo"
                         else len(idx) / len(completions))
                scaler.scale(out.loss * share).backward()
                _add_grads_to_masters(trainable, masters)
                stats["loss"] += out.loss.item() * share
                # the logged token means are the batch's whatever the loss's weighting and the micro-batching (gspo's
                # clip ratio counts sequences)
                tokens = mask.sum().item() / total_tokens
                rows_share = int((mask.sum(-1) > 0).sum().item()) / total_rows
                stats["kl"] += out.kl * tokens
                stats["clip_ratio"] += out.clip_ratio * (rows_share if config.loss_type == "gspo" else tokens)
                stats["mismatch_kl"] += mismatch_kl(logp.detach(), rollout_logp, mask).item() * tokens
                if is_weights is not None:
                    stats["is_weight_mean"] += ((is_weights * mask).sum() / mask.sum().clamp_min(1)).item() * tokens
        loss_scale = scaler.get_scale() if scaler.is_enabled() else None
        scaler.unscale_(optimizer)  # the masters' float32 gradients, before clipping sees them
        # max_grad_norm 0: no clipping, as in transformers' Trainer and TRL (the norm is still measured and logged)
        grad_norm = torch.nn.utils.clip_grad_norm_(list(masters.values()),
                                                   config.max_grad_norm or math.inf).item()
        skipped = not math.isfinite(grad_norm)  # an fp16 overflow: keep the adapter, drop this step's update
        if not skipped:
            scaler.step(optimizer)
        scaler.update()  # float16: halves the scale after an overflow, doubles it after 2000 clean steps
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in trainable.items():
                if masters[name] is not p:
                    p.copy_(masters[name])
        rollout.sync_lora(model)  # the engine samples the next step from the updated adapter
        rollout.wake()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_s = time.perf_counter() - t0

        completion_tokens = int(batch["mask"].sum().item())
        # as TRL logs them: reward_mean and reward_std over the batch's scored completions, and the share of
        # completions whose reward std (the scaling's: their group's, or the batch's) is 0: they get no advantage
        std = reward_stds(rewards, n, config.effective_scale_rewards)
        metrics = {"step": step, "reward_mean": rewards.nanmean().item(), "reward_std": nanstd(rewards).item(),
                   "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
                   **per_func, **stats, "grad_norm": grad_norm, "lr": lr, "update_skipped": skipped,
                   "completion_length": completion_tokens / len(completions),
                   "rollout_tokens_per_s": completion_tokens / gen_s,
                   "train_tokens_per_s": int(batch["attention_mask"].sum().item()) / train_s,
                   "generation_s": gen_s, "training_s": train_s,
                   "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
        if not config.importance_sampling:
            del metrics["is_weight_mean"]
        if loss_scale is not None:
            metrics["loss_scale"] = loss_scale
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
        if config.save_steps and (step % config.save_steps == 0 or step == config.steps):  # the last step too
            save_checkpoint(Path(config.output_dir) / f"checkpoint-{step}", model, optimizer, masters, step, config,
                            scaler)
    return history
