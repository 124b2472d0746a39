"""The FP8 GRPO runtime on CPU: the toy run learns, a resumed run replays the next step exactly, load_model's
variants, the reference policy, float16, and bad input."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fp8kit import convert
from fp8kit.errors import Fp8kitError
from fp8kit.models import add_tokenizer, build_checkpoint
from fp8kit.rl.grpo import GRPOConfig, learning_rate_at, train
from fp8kit.rl.loader import adapters_disabled, lora_modules
from fp8kit.rl.model import load_model

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "evals" / "grpo_toy.py"


def _toy(workdir: Path, *args: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(workdir), *args], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{") and '"step"' in line]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """The toy model built, pre-trained and converted once (by a one-step run of the script)."""
    workdir = tmp_path_factory.mktemp("toy")
    _toy(workdir, "--steps", "1")
    return workdir


def test_toy_reward_rises(toy_dir):
    steps = _toy(toy_dir, "--steps", "20", "--seed", "0")
    assert [s["step"] for s in steps] == list(range(1, 21))
    first = sum(s["reward_mean"] for s in steps[:4]) / 4
    last = sum(s["reward_mean"] for s in steps[-4:]) / 4
    assert last > first + 0.25, (first, last)
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0
        assert s["mismatch_kl"] >= 0.0 and s["generation_s"] > 0 and s["training_s"] > 0
        assert s["rollout_tokens_per_s"] > 0 and s["peak_gpu_memory_bytes"] is None


def test_resume_replays_the_next_step(toy_dir, tmp_path):
    out = tmp_path / "run"
    full = _toy(toy_dir, "--steps", "3", "--output-dir", str(out), "--save-steps", "1")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not list(tmp_path.rglob("*.partial-*"))
    again = tmp_path / "again"
    resumed = _toy(toy_dir, "--steps", "3", "--resume", str(out / "checkpoint-2"), "--output-dir", str(again),
                   "--save-steps", "1")
    assert [s["step"] for s in resumed] == [3]
    for key in ("reward_mean", "reward_std", "completion_length"):
        assert resumed[0][key] == full[2][key], key
    assert resumed[0]["loss"] == pytest.approx(full[2]["loss"], abs=1e-6)
    assert resumed[0]["grad_norm"] == pytest.approx(full[2]["grad_norm"], rel=1e-4)
    # the update after the resumed step used the restored AdamW state: same adapter, master weights and moments
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert (again / "checkpoint-3" / name).read_bytes() == (out / "checkpoint-3" / name).read_bytes(), name


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    src = build_checkpoint(tmp_path_factory.mktemp("grpo") / "llama", "llama", torch.bfloat16, seed=3)
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 50, vocab_size=300)
    return src


@pytest.fixture(scope="module")
def tiny_fp8(tiny_llama):
    from fp8kit import convert

    out = tiny_llama.parent / "llama-fp8"
    convert(tiny_llama, out, scheme="dynamic")
    return out


def test_load_model_variants(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "cache"))
    fp8, tok = load_model(str(tiny_llama), load_in_fp8=True, lora_rank=4, device="cpu")
    assert fp8.fp8_scheme == "dynamic" and fp8.rollout_engine.name == "transformers"
    assert tok.pad_token_id is not None
    assert list((tmp_path / "cache").rglob("fp8kit-entry.json"))  # converted once, through the registry cache
    block, _ = load_model(str(tiny_llama), load_in_fp8="block", lora_rank=4, device="cpu")
    assert block.fp8_scheme == "block"
    base, _ = load_model(str(tiny_llama), load_in_fp8=False, lora_rank=4, device="cpu")
    assert base.fp8_scheme is None
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert all(m.weight.dtype == torch.bfloat16 for m in lora_modules(base).values())
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in lora_modules(fp8).values())
    converted = next(m.parent for m in (tmp_path / "cache").rglob("fp8kit-entry.json")
                     if json.loads(m.read_text())["scheme"] == "dynamic")
    with pytest.raises(Fp8kitError, match="already an FP8 checkpoint"):
        load_model(str(converted), load_in_fp8=False)
    with pytest.raises(Fp8kitError, match="load_in_fp8"):
        load_model(str(tiny_llama), load_in_fp8="tensor")
    with pytest.raises(Fp8kitError, match="a dynamic FP8 checkpoint, not block"):
        load_model(str(converted), load_in_fp8="block")


def test_checkpoint_mismatches_finds_a_wrong_view(tiny_fp8, tiny_llama):
    from fp8kit.rl.loader import checkpoint_mismatches

    model, _ = load_model(str(tiny_fp8), lora_rank=4, device="cpu")
    assert checkpoint_mismatches(model, tiny_fp8) == []
    base, _ = load_model(str(tiny_llama), load_in_fp8=False, lora_rank=4, device="cpu")
    assert checkpoint_mismatches(base, tiny_llama) == []
    layer = model.model.layers[0]
    with torch.no_grad():  # what a swapped gate/up split would look like
        gate, up = layer.mlp.gate_proj.weight.clone(), layer.mlp.up_proj.weight.clone()
        layer.mlp.gate_proj.weight.copy_(up)
        layer.mlp.up_proj.weight.copy_(gate)
        model.model.norm.weight.add_(1)
    assert sorted(checkpoint_mismatches(model, tiny_fp8)) == ["model.layers.0.mlp.gate_proj.weight",
                                                              "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


def test_adapters_disabled_is_the_base_model(tiny_fp8):
    model, _ = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for m in lora_modules(model).values():
            m.lora_B.normal_()
        with adapters_disabled(model):
            base = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(base, before)  # B starts at zero: the fresh adapter is the base model
    assert not torch.allclose(after, before)


@pytest.mark.parametrize("loss_type,beta,dtype", [("dr_grpo", 0.0, torch.float32), ("dapo", 0.0, torch.bfloat16),
                                                  ("gspo", 0.04, torch.float16), ("grpo", 0.04, torch.float16)])
def test_each_loss_trains_a_step(tiny_fp8, loss_type, beta, dtype):
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=dtype, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def length_reward(prompts, completions, **_):
        return [len(c) / 40 for c in completions]

    config = GRPOConfig(steps=2, prompts_per_step=2, num_generations=4, max_completion_length=6,
                        loss_type=loss_type, beta=beta, learning_rate=1e-2, gradient_accumulation_steps=2)
    history = train(model, tok, ["the quick", "lazy dog", "brown fox"], [length_reward], config)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert all(v == v for v in h.values() if isinstance(v, float)), h  # no NaN
        assert (h["kl"] > 0) == (beta > 0 and h["step"] == 2)  # the adapter moves away only after step 1
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed


def _seeded_lora_model(tiny_fp8, dtype):
    """The same adapter every time, its B non-zero so that every LoRA parameter gets a gradient."""
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=dtype, device="cpu")
    with torch.no_grad():
        for i, m in enumerate(lora_modules(model).values()):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return model, tok


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_gradient_accumulation_matches_one_batch(tiny_fp8, loss_type):
    """Uneven micro-batches (8 rows in 3, or one row each) of completions of uneven lengths (one empty) weigh rows
    and tokens as the whole batch does, in the gradient and in the logged token means."""
    from fp8kit.rl.rollout import Completion, HFRollout

    class Uneven(HFRollout):
        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            return [Completion(c.token_ids[:n], c.logprobs[:n]) for c, n in zip(out, [6, 1, 4, 0, 3, 6, 2, 5])]

    norms, logged = [], []
    for accumulation in (1, 3, 8):
        model, tok = _seeded_lora_model(tiny_fp8, torch.float32)  # the same adapter in every run

        def length_reward(prompts, completions, **_):
            return [len(c) / 40 for c in completions]

        config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=6, seed=5,
                            loss_type=loss_type, gradient_accumulation_steps=accumulation, gradient_checkpointing=False,
                            beta=0.04)
        step = train(model, tok, ["the quick", "lazy dog"], [length_reward], config, rollout=Uneven(model, tok))[0]
        norms.append(step["grad_norm"])
        logged.append(step)
    assert norms[0] > 0 and logged[0]["kl"] > 0
    for other in (1, 2):
        assert norms[other] == pytest.approx(norms[0], rel=1e-4), norms
        assert logged[other]["kl"] == pytest.approx(logged[0]["kl"], rel=1e-4)
        assert logged[other]["is_weight_mean"] == pytest.approx(logged[0]["is_weight_mean"], rel=1e-6)
        assert logged[other]["mismatch_kl"] == pytest.approx(logged[0]["mismatch_kl"], abs=1e-9)
        assert logged[other]["clip_ratio"] == pytest.approx(logged[0]["clip_ratio"], abs=1e-9)


def _fixed_rollout(lengths, seed=1):
    """Completions of the given lengths with seeded tokens and rollout log-probabilities of their own (not the
    trainer's, as a vLLM engine's differ): the importance weights are active and some hit the cap. The prompts it
    was asked for are kept for a reference loss."""
    from fp8kit.rl.rollout import Completion, HFRollout

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 290, (len(lengths), max(lengths)), generator=g).tolist()
    logps = (-torch.rand(len(lengths), max(lengths), generator=g) * 10).tolist()

    class Fixed(HFRollout):
        prompts: list = []

        def generate(self, prompt_ids, n, *args, **kwargs):
            Fixed.prompts = [list(p) for p in prompt_ids]
            return [Completion(ids[i][:k], logps[i][:k]) for i, k in enumerate(lengths)]

    return Fixed


def _sum_reward(completion_ids, **_):
    return [float(sum(c) % 7) for c in completion_ids]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_a_steps_gradient_is_the_reference_loss_written_out(tiny_fp8, loss_type):
    """train()'s gradient against TRL's loss written out row by row from plain unpadded forwards, in float64 sums:
    group-normalized advantages, the clipped ratio, importance weights exp(trainer - rollout) capped, the k3 KL to
    the adapters-off model, temperature, and each loss type's normalizer; one batch and three uneven micro-batches.
    Tolerance: 1e-5 relative on the gradient (float32 forwards; the runs agree to ~1e-6)."""
    lengths, n, width = [6, 1, 4, 0, 3, 6, 2, 5], 4, 8  # no completion reaches max_completion_length
    config = dict(steps=1, prompts_per_step=2, num_generations=n, max_completion_length=width, seed=5,
                  loss_type=loss_type, gradient_checkpointing=False, beta=0.1, temperature=0.7, learning_rate=0.0)
    grads = []
    for accumulation in (1, 3):
        model, tok = _seeded_lora_model(tiny_fp8, torch.float32)
        seen = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, name=name: seen.__setitem__(name, p.grad.double()))
        rollout = _fixed_rollout(lengths)(model, tok)
        cfg = GRPOConfig(**config, gradient_accumulation_steps=accumulation)
        logged = train(model, tok, ["the quick", "lazy dog"], [_sum_reward], cfg, rollout=rollout)[0]
        grads.append(seen)
    prompts, completions = rollout.prompts, rollout.generate(rollout.prompts, n)

    model, tok = _seeded_lora_model(tiny_fp8, torch.float32)
    rewards = torch.tensor(_sum_reward([c.token_ids for c in completions]), dtype=torch.float64).view(-1, n)
    advantages = rewards - rewards.mean(1, keepdim=True)
    if cfg.effective_scale_rewards in (True, "group"):
        advantages = advantages / (rewards.std(1, keepdim=True) + 1e-4)
    low, high = 1 - cfg.epsilon, 1 + cfg.effective_epsilon_high
    rows, capped, drift = [], 0, []
    for i, c in enumerate(completions):
        prompt, target = prompts[i // n], torch.tensor(c.token_ids, dtype=torch.long)
        ids = torch.tensor([prompt + c.token_ids])

        def token_logps():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double() / cfg.temperature
            return logits.log_softmax(-1).gather(-1, target[:, None])[:, 0]

        logp = token_logps()
        with torch.no_grad(), adapters_disabled(model):
            ref = token_logps()
        old = logp.detach()
        ratio = torch.exp(logp - old)
        if loss_type == "gspo":  # the sequence's mean log-ratio, one ratio for all its tokens
            ratio = torch.exp((logp - old).mean()).expand(len(logp)) if len(logp) else ratio
        a = advantages.view(-1)[i]
        loss = -torch.min(ratio * a, ratio.clamp(low, high) * a)
        weights = torch.exp(old - torch.tensor(c.logprobs, dtype=torch.float64))
        drift.append(old - torch.tensor(c.logprobs, dtype=torch.float64))  # trainer - rollout, per token
        capped += int((weights > cfg.importance_sampling_cap).sum())
        loss = loss * weights.clamp(max=cfg.importance_sampling_cap)
        rows.append(loss + cfg.beta * (torch.exp(ref - logp) - (ref - logp) - 1))
    if loss_type in ("grpo", "gspo"):
        total = torch.stack([r.sum() / max(1, len(r)) for r in rows]).mean()
    elif loss_type == "dr_grpo":
        total = sum(r.sum() for r in rows) / (len(rows) * width)
    else:
        total = sum(r.sum() for r in rows) / sum(len(r) for r in rows)
    total.backward()
    expected = {name: p.grad.double() for name, p in model.named_parameters() if p.requires_grad}
    assert 0 < capped < sum(lengths)  # the cap is exercised, and not on every token
    scale = sum(float(g.norm() ** 2) for g in expected.values()) ** 0.5
    assert scale > 0 and logged["loss"] == pytest.approx(total.item(), rel=1e-5, abs=1e-7)
    # the logged mismatch KL is KL(rollout || trainer), k3 over the tokens the rollout sampled, the batch's token mean
    d = torch.cat(drift)
    assert logged["mismatch_kl"] == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-4)
    for got in grads:
        assert set(got) == set(expected)
        error = sum(float((got[k] - expected[k]).norm() ** 2) for k in expected) ** 0.5
        assert error <= 1e-5 * scale, (error, scale)


def _record_stepped_gradients(monkeypatch) -> list:
    """The gradients the optimizer steps on (the float32 masters', unscaled), in the trainable parameters' order, as
    train() hands them to clip_grad_norm_."""
    stepped = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(params, *args, **kwargs):
        stepped[:] = [p.grad.double().clone() for p in params]
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    return stepped


def test_bfloat16_micro_batch_gradients_add_up_in_float32(tiny_fp8, monkeypatch):
    """With LoRA parameters in bfloat16, the gradient the optimizer steps on is the float32 sum of the micro-batches'
    gradients: summed in bfloat16, 8 micro-batches were 0.4% off. Tolerance: 1e-6 relative (float32 sums of the
    same bfloat16 gradients)."""
    lengths = torch.randint(1, 12, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    model, tok = _seeded_lora_model(tiny_fp8, torch.bfloat16)
    exact = {}
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: exact.__setitem__(name, exact.get(name, 0) + g.double()))
    stepped = _record_stepped_gradients(monkeypatch)
    cfg = GRPOConfig(steps=1, prompts_per_step=4, num_generations=8, max_completion_length=12, seed=5,
                     gradient_accumulation_steps=8, gradient_checkpointing=False, learning_rate=0.0, loss_type="dapo")
    train(model, tok, ["the quick", "lazy dog", "brown fox", "jumps over"], [_sum_reward], cfg,
          rollout=_fixed_rollout(lengths, seed=2)(model, tok))
    assert len(stepped) == len(names)
    scale = sum(float(exact[k].norm() ** 2) for k in names) ** 0.5
    error = sum(float((g - exact[k]).norm() ** 2) for g, k in zip(stepped, names)) ** 0.5
    assert scale > 0 and error <= 1e-6 * scale, (error, scale)


def test_dropout_is_off_while_training_and_restored(tiny_fp8, tmp_path):
    """The rollout samples without dropout; scored with it, the importance weights would measure dropout noise.
    Attention layers apply config.attention_dropout themselves (a float, not an nn.Dropout): it was left on."""
    from fp8kit.rl.loader import load_fp8_model

    _, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    with_dropout = tmp_path / "attention-dropout"
    shutil.copytree(tiny_fp8, with_dropout)
    config_json = json.loads((with_dropout / "config.json").read_text())
    (with_dropout / "config.json").write_text(json.dumps({**config_json, "attention_dropout": 0.3}))

    model = load_fp8_model(with_dropout, torch.float32, lora_rank=4, lora_dropout=0.3)
    attention = [m for m in model.modules() if getattr(m, "attention_dropout", None) == 0.3]
    assert attention
    with torch.no_grad():
        for i, m in enumerate(lora_modules(model).values()):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=6,
                        gradient_checkpointing=False, output_dir=str(tmp_path / "run"), save_steps=1)
    step = train(model, tok, ["the quick", "lazy dog"], [lambda completions, **_: [len(c) / 40 for c in completions]],
                 config)[0]
    assert step["mismatch_kl"] < 1e-5 and step["is_weight_mean"] == pytest.approx(1.0, abs=1e-3), step
    assert {m.lora_dropout.p for m in lora_modules(model).values()} == {0.3}
    assert {m.attention_dropout for m in attention} == {0.3}
    # the checkpoint's adapter says how it was configured (the dropout was saved while turned off, as 0.0) and names
    # its base, which peft's AutoPeftModelForCausalLM opens (it was "")
    saved = json.loads((tmp_path / "run" / "checkpoint-1" / "adapter_config.json").read_text())
    assert saved["lora_dropout"] == 0.3 and saved["base_model_name_or_path"] == str(with_dropout)


@pytest.mark.parametrize("field,value", [("gradient_accumulation_steps", 0), ("prompts_per_step", 0),
                                         ("max_completion_length", 0), ("temperature", 0.0), ("top_p", 1.5),
                                         ("importance_sampling_cap", 0.0), ("steps", 2.5), ("learning_rate", -1e-5),
                                         ("beta", -0.1), ("weight_decay", -1.0), ("epsilon", float("nan")),
                                         ("warmup_steps", "2"), ("num_generations", 2.5), ("num_generations", "4"),
                                         ("save_steps", -1), ("seed", 1.5), ("adam_betas", (1.5, 0.9)),
                                         ("torch_compile", "false"), ("max_grad_norm", -1.0),
                                         ("max_grad_norm", float("inf"))])
def test_config_values_that_would_fail_after_a_rollout_are_refused(field, value):
    with pytest.raises(Fp8kitError) as e:
        GRPOConfig(**{field: value})
    assert str(e.value).startswith(f"{field}={value!r}")


def test_learning_rate_schedules():
    c = GRPOConfig(steps=10, learning_rate=1.0, warmup_steps=2, lr_scheduler="linear")
    assert [learning_rate_at(c, s) for s in (1, 2, 3, 6, 10)] == pytest.approx([0.0, 0.5, 1.0, 0.625, 0.125])
    c = GRPOConfig(steps=10, learning_rate=1.0, warmup_steps=0, lr_scheduler="cosine")
    assert learning_rate_at(c, 1) == 1.0
    assert learning_rate_at(c, 6) == pytest.approx(0.5)  # halfway: 0.5 * (1 + cos(pi / 2))
    assert learning_rate_at(c, 10) == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)))  # the last step still learns
    assert GRPOConfig(loss_type="dapo").effective_epsilon_high == 0.28
    assert GRPOConfig(loss_type="dr_grpo").effective_scale_rewards == "none"


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("steps, warmup", [(6, 2), (10, 0), (4, 1), (5, 5)])
def test_learning_rate_schedules_are_transformers_step_for_step(schedule, steps, warmup):
    """TRL's GRPOTrainer takes its rates from transformers' get_scheduler, which counts steps from 0: a warmup's first
    step has rate 0. fp8kit's was one step ahead (warmup_steps=1 warmed nothing up)."""
    from transformers import get_scheduler

    c = GRPOConfig(steps=steps, learning_rate=1.0, warmup_steps=warmup, lr_scheduler=schedule)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    name = {"constant": "constant_with_warmup"}.get(schedule, schedule)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    theirs = []
    for _ in range(steps):  # the rate each optimizer step uses: optimizer.step(), then scheduler.step()
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [learning_rate_at(c, s) for s in range(1, steps + 1)] == pytest.approx(theirs, abs=1e-12)


def test_numpy_numbers_are_numbers_in_the_config(tmp_path):
    """np.int64(3) and np.float32(1e-4) were refused ("expected an integer >= 1"); they are stored as Python's, so
    the checkpoint's trainer_state.json can hold them."""
    import numpy as np

    c = GRPOConfig(steps=np.int64(3), num_generations=np.int64(4), learning_rate=np.float32(1e-4),
                   adam_betas=(np.float32(0.9), np.float64(0.99)), output_dir=str(tmp_path))
    assert (c.steps, c.num_generations) == (3, 4) and type(c.steps) is int and type(c.learning_rate) is float
    assert c.learning_rate == pytest.approx(1e-4) and all(type(b) is float for b in c.adam_betas)
    json.dumps(dataclasses.asdict(c))
    with pytest.raises(Fp8kitError, match="num_generations=1"):
        GRPOConfig(num_generations=np.int64(1))


def test_gradients_left_on_the_lora_parameters_do_not_reach_the_first_step(tiny_fp8):
    """A backward of the caller's own, or a step that died midway (out of memory in its second micro-batch, Ctrl-C),
    left .grad on the LoRA parameters; train() added it into its first step."""
    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4,
                        learning_rate=1e-3, seed=3)
    logs = []
    for dirty in (False, True):
        model, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu", dtype=torch.float32)
        if dirty:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.full_like(p, 3.0)
        logs.append(train(model, tok, ["the quick", "a lazy dog"], [_sum_reward], config)[0])
    assert logs[1]["grad_norm"] == pytest.approx(logs[0]["grad_norm"], rel=1e-6)


def test_max_grad_norm_zero_is_no_clipping(tiny_fp8):
    """transformers' Trainer and TRL take max_grad_norm=0 as no clipping; it was refused. The step it takes is the
    unclipped one (a threshold far above the norm), and the one a small threshold clips differs."""
    from fp8kit.rl.loader import lora_modules

    adapters = {}
    for norm in (0.0, 1e9, 1e-4):
        config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4,
                            learning_rate=1e-2, max_grad_norm=norm, seed=3)
        model, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu", dtype=torch.float32)
        log = train(model, tok, ["the quick", "a lazy dog"], [_sum_reward], config)[0]
        assert log["grad_norm"] > 1e-4 and not log["update_skipped"], log
        adapters[norm] = torch.cat([m.lora_B.detach().flatten() for m in lora_modules(model).values()])
    assert torch.equal(adapters[0.0], adapters[1e9])
    assert not torch.allclose(adapters[0.0], adapters[1e-4])


@pytest.mark.parametrize("edit", [{"step": None}, {"step": "x"}, {"optimizer_steps": []}],
                         ids=["null-step", "text-step", "list-of-steps"])
def test_a_hand_edited_trainer_state_is_refused_before_the_adapter_changes(tiny_fp8, tmp_path, edit):
    """It raised a bare TypeError after load_adapter had replaced the model's adapter, or ([]) resumed without
    AdamW's state."""
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2, seed=1,
                        output_dir=str(tmp_path / "run"), save_steps=1, learning_rate=1e-2)
    model, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu", dtype=torch.float32)
    train(model, tok, ["the"], [_sum_reward], config)
    state_file = tmp_path / "run" / "checkpoint-1" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), **edit}))
    fresh, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu", dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters() if p.requires_grad}
    with pytest.raises(Fp8kitError) as e:
        train(fresh, tok, ["the"], [_sum_reward], dataclasses.replace(config, steps=2),
              resume_from=tmp_path / "run" / "checkpoint-1")
    assert "trainer_state.json: 'step' must be an integer" in str(e.value) and "\n" not in str(e.value)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters() if p.requires_grad)


def test_bad_input(tiny_fp8, tmp_path):
    with pytest.raises(Fp8kitError, match="loss_type"):
        GRPOConfig(loss_type="ppo")
    with pytest.raises(Fp8kitError, match="num_generations"):
        GRPOConfig(num_generations=1)
    with pytest.raises(Fp8kitError, match="save_steps needs output_dir"):
        GRPOConfig(save_steps=1)
    model, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    with pytest.raises(Fp8kitError, match="prompts"):
        train(model, tok, [], [lambda prompts, completions, **_: [0.0] * len(completions)], config)
    with pytest.raises(Fp8kitError, match="returned 1 values for 2"):
        train(model, tok, ["the"], [lambda prompts, completions, **_: [0.0]], config)
    for returned, needle in ((None, "returned NoneType"), (0.5, "returned float"), (["good", "bad"], "returned list"),
                             ([[1.0], [2.0]], "returned list"), ([1.0, math.inf], "returned inf for completion 1")):
        with pytest.raises(Fp8kitError) as e:  # each was a torch or Python traceback after the rollout (inf: NaN loss)
            train(model, tok, ["the"], [lambda prompts, completions, r=returned, **_: r], config)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value
    with pytest.raises(Fp8kitError, match="load_in_fp8=0"):  # 0 == False passed the check, then loaded FP8
        load_model(str(tiny_fp8), load_in_fp8=0)
    for length in (-5, 1, 2.5):
        with pytest.raises(Fp8kitError, match=f"max_seq_length={length!r}"):
            load_model(str(tiny_fp8), max_seq_length=length)
    short, _ = load_model(str(tiny_fp8), lora_rank=4, device="cpu", max_seq_length=8)
    with pytest.raises(Fp8kitError, match="prompt 1 has 9 tokens, and max_seq_length=8"):
        train(short, tok, ["the", "the quick brown fox jumps over the lazy dog"],
              [lambda prompts, completions, **_: [0.0] * len(completions)], config)
    seen = []
    train(short, tok, ["the quick"], [lambda completion_ids, **_: (seen.extend(map(len, completion_ids)),
                                                                   [0.0] * len(completion_ids))[1]],
          GRPOConfig(steps=1, prompts_per_step=1, num_generations=4, max_completion_length=20))
    assert seen and max(seen) <= 8 - len(tok("the quick")["input_ids"]), seen  # ends at max_seq_length, as vLLM
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(Fp8kitError, match="ckpt: no fp8kit GRPO checkpoint there"):
        train(model, tok, ["the"], [lambda prompts, completions, **_: [0.0] * 2], config, resume_from=tmp_path / "ckpt")
    with pytest.raises(Fp8kitError, match="reward_weights has 2 values for 1"):
        train(model, tok, ["the"], [lambda prompts, completions, **_: [0.0] * 2],
              GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, reward_weights=[1.0, 2.0]))
    with pytest.raises(Fp8kitError, match="latest: no fp8kit GRPO checkpoint there"):
        train(model, tok, ["the"], [lambda prompts, completions, **_: [0.0] * 2], config,
              resume_from=tmp_path / "ckpt" / "latest")
    (tmp_path / "ckpt" / "trainer_state.json").write_text("{}")  # readable, but not ours
    (tmp_path / "ckpt" / "optimizer.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Fp8kitError, match="not a readable fp8kit GRPO checkpoint"):
        train(model, tok, ["the"], [lambda prompts, completions, **_: [0.0] * 2], config, resume_from=tmp_path / "ckpt")
    from fp8kit.rl.vllm_engine import VLLMRollout

    with pytest.raises(Fp8kitError, match="vLLM serves LoRA ranks"):  # refused before vLLM is even imported
        VLLMRollout(tiny_fp8, lora_rank=4)
    with pytest.raises(Fp8kitError, match="need torch.bfloat16 or torch.float16"):
        VLLMRollout(tiny_fp8, dtype=torch.float32)
    head = convert(build_checkpoint(tmp_path / "untied", "llama", torch.bfloat16, seed=1), tmp_path / "head",
                   scheme="dynamic", lm_head=True).out
    with pytest.raises(Fp8kitError, match="lm_head is FP8"):  # also before vLLM is imported
        VLLMRollout(head)
    frozen, tok = load_model(str(tiny_fp8), lora_rank=0, device="cpu")
    with pytest.raises(Fp8kitError, match="no trainable LoRA"):
        train(frozen, tok, ["the"], [lambda prompts, completions, **_: [0.0] * 2], config)


def test_rollout_engine_keeps_precision_casts_for_fp8_checkpoints(tmp_path, llama_dir):
    """vLLM compiles FP8 checkpoints with the model-dtype rounding kept before activation quantization (the trainer
    rounds there) and prefills in chunks that bound its activation memory; BF16 checkpoints keep vLLM's compile
    settings, and a caller's own values win."""
    from fp8kit.rl.vllm_engine import KEEP_PRECISION_CASTS, ROLLOUT_MAX_BATCHED_TOKENS, rollout_engine_kwargs

    fp8 = Path(convert(llama_dir, tmp_path / "fp8", scheme="dynamic").out)
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    bf16_qc = json.loads((Path(llama_dir) / "config.json").read_text()).get("quantization_config") or {}
    chunks = {"max_num_batched_tokens": ROLLOUT_MAX_BATCHED_TOKENS}
    assert ROLLOUT_MAX_BATCHED_TOKENS == 2048
    assert rollout_engine_kwargs(qc, {"kv_cache_memory_bytes": 1}) == {
        "kv_cache_memory_bytes": 1, "compilation_config": KEEP_PRECISION_CASTS, **chunks}
    assert KEEP_PRECISION_CASTS["inductor_compile_config"]["emulate_precision_casts"] is True
    assert rollout_engine_kwargs(bf16_qc, {"kv_cache_memory_bytes": 1}) == {"kv_cache_memory_bytes": 1, **chunks}
    assert rollout_engine_kwargs(qc, {"compilation_config": {}, "max_num_batched_tokens": 16384}) == {
        "compilation_config": {}, "max_num_batched_tokens": 16384}
    assert rollout_engine_kwargs(bf16_qc, {"max_num_seqs": 4096})["max_num_batched_tokens"] == 4096
    assert "max_num_batched_tokens" not in rollout_engine_kwargs(bf16_qc, {"enable_chunked_prefill": False})


def test_weights_vllm_padded_for_cutlass_are_shared_as_the_layers_own_views():
    """vLLM's CUTLASS FP8 kernel pads a weight whose dimensions are not multiples of 16 (zeros; its per-channel scale
    with ones) and stores it transposed: the trainer's weights are the unpadded [out, in] views of that storage (the
    fused gate/up split as well); before, the padded shapes were refused as a checkpoint not matching its config.
    The vLLM layers are made here as vLLM 0.25's padding code lays them out (kernels/linear/scaled_mm/cutlass.py);
    on the GPU, tests/test_gpu_grpo.py's llama_odd runs vLLM's own (padded along the inputs only: vLLM 0.25 fails
    to load a per-channel layer it pads along its outputs)."""
    from torch import nn
    from transformers import LlamaConfig

    from fp8kit.rl.vllm_engine import _rows, shared_tensors

    config = LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=90)
    g = torch.Generator().manual_seed(0)

    def vllm_layer(out_n, in_k):
        weight = (torch.randn(out_n, in_k, generator=g) * 50).to(torch.float8_e4m3fn)
        scale = torch.rand(out_n, 1, generator=g) + 0.5
        pad_n, pad_k = -out_n % 16, -in_k % 16
        stored = torch.zeros(out_n + pad_n, in_k + pad_k, dtype=torch.float8_e4m3fn)
        stored[:out_n, :in_k] = weight
        layer = nn.Module()
        layer.input_size, layer.output_size = in_k, out_n
        layer.weight = nn.Parameter(stored.t(), requires_grad=False)  # [in, out] over [out, in] storage
        layer.weight_scale = nn.Parameter(torch.cat([scale, torch.ones(pad_n, 1)]), requires_grad=False)
        return layer, weight, scale

    model, want = nn.Module(), {}
    model.model = nn.Module()
    layers = nn.ModuleList([nn.Module()])
    model.model.layers = layers
    layers[0].mlp = nn.Module()
    for short, out_n, in_k in [("gate_up_proj", 200, 64), ("down_proj", 64, 100)]:
        layer, weight, scale = vllm_layer(out_n, in_k)
        setattr(layers[0].mlp, short, layer)
        want[short] = (weight, scale)
    tensors = {k: get() for k, get in shared_tensors(model, config, "dynamic").items()}
    gate_up, down = layers[0].mlp.gate_up_proj, layers[0].mlp.down_proj
    for name, (lo, hi), short in [("gate_proj", (0, 100), "gate_up_proj"), ("up_proj", (100, 200), "gate_up_proj"),
                                  ("down_proj", (0, 64), "down_proj")]:
        weight, scale = tensors[f"model.layers.0.mlp.{name}.weight"], tensors[f"model.layers.0.mlp.{name}.weight_scale"]
        assert weight.shape == want[short][0][lo:hi].shape and scale.shape == (hi - lo, 1), name
        assert torch.equal(weight.view(torch.uint8), want[short][0][lo:hi].view(torch.uint8)), name
        assert torch.equal(scale, want[short][1][lo:hi]), name
        stored = _rows(getattr(layers[0].mlp, short).weight)
        assert weight.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr(), name  # views, no copies
    assert _rows(down.weight).shape == (64, 112) and _rows(gate_up.weight).shape == (208, 64)  # vLLM's padding


def test_the_rollout_engine_reads_its_own_settings_past_vllms_cache(monkeypatch):
    """vLLM caches its environment once an engine has run in the process (vllm/envs.py: the module's __getattr__
    wrapped in functools.cache, unwrapped by disable_envs_cache); a cached VLLM_ENABLE_V1_MULTIPROCESSING=1 started
    the rollout engine in a subprocess. Here vllm.envs is made as vLLM leaves it (tests/test_gpu_grpo.py runs vLLM's)."""
    import functools
    import sys
    import types

    from fp8kit.rl.vllm_engine import set_engine_environment

    envs = types.ModuleType("vllm.envs")
    envs.__getattr__ = functools.cache(lambda name: os.environ.get(name) == "1")
    envs.disable_envs_cache = lambda: setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING  # read once, cached
    set_engine_environment()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False


def test_transformers_rollout_stops_at_every_eos_of_the_generation_config(tiny_fp8, tmp_path):
    """vLLM stops at each eos_token_id of generation_config.json (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>),
    not only at the tokenizer's EOS; the CPU engine must sample the same completions."""
    import shutil

    from fp8kit.rl.rollout import HFRollout

    ckpt = tmp_path / "two-eos"
    shutil.copytree(tiny_fp8, ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    _, tok = load_model(str(ckpt), lora_rank=4, dtype=torch.float32, device="cpu")
    stop = 5
    assert stop != tok.eos_token_id
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [tok.eos_token_id, stop]}))
    model, tok = load_model(str(ckpt), lora_rank=4, dtype=torch.float32, device="cpu")
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():  # the extra stop token made likely, so that completions reach it early
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[stop] = 6.0
    model.lm_head = head
    completions = HFRollout(model, tok).generate([tok("the quick")["input_ids"]], 4, 12, seed=0)
    assert all(len(c.token_ids) == len(c.logprobs) for c in completions)
    ended = [c for c in completions if stop in c.token_ids]
    assert ended and all(c.token_ids.index(stop) == len(c.token_ids) - 1 for c in ended)
    assert any(len(c.token_ids) < 12 for c in ended)


def test_unreadable_generation_config_is_one_line(tiny_fp8, tmp_path):
    import shutil

    ckpt = tmp_path / "bad-gen"
    shutil.copytree(tiny_fp8, ckpt)
    (ckpt / "generation_config.json").write_text("{not json")
    with pytest.raises(Fp8kitError) as e:
        load_model(str(ckpt), lora_rank=4, dtype=torch.float32, device="cpu")
    assert str(ckpt / "generation_config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args,needle", [(["--loss-type", "ppo"], "loss_type 'ppo'"),
                                         (["--save-steps", "1"], "save_steps needs output_dir"),
                                         (["--steps", "0"], "steps=0"),
                                         (["--resume", "no-such-run/checkpoint-3"], "no fp8kit GRPO checkpoint")])
def test_toy_script_refuses_bad_arguments_in_one_line_before_building_anything(tmp_path, args, needle):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(tmp_path / "toy"), *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: ") and needle in proc.stderr
    assert not (tmp_path / "toy").exists()  # refused before the toy model was pre-trained


def test_prompts_reach_the_tokenizer_one_string_at_a_time(tiny_fp8):
    """The max_seq_length check passed the whole prompt list in one call: a tokenizer that takes one string (as each
    step calls it; evals/grpo_gpu.py has one) failed with 'unhashable type: list' before the first step."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, device="cpu", max_seq_length=64)

    class OneString:
        pad_token_id, eos_token_id = tok.pad_token_id, tok.eos_token_id

        def __call__(self, text):
            assert isinstance(text, str), text
            return tok(text)

        def batch_decode(self, ids, **kwargs):
            return tok.batch_decode(ids, **kwargs)

    steps = train(model, OneString(), ["the quick", "lazy dog"], [lambda completions, **_: [0.0] * len(completions)],
                  GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4))
    assert [s["step"] for s in steps] == [1]


def test_float16_gradients_are_loss_scaled(tiny_llama, monkeypatch):
    """float16's smallest normal is 6e-5 and a GRPO loss averages over every completion token. Unscaled, this tiny
    model's LoRA gradient was 0.78% off float32's and 20 entries flushed to zero; with dynamic loss scaling 0.11%
    off, for the same completions (a fixed rollout), from the BF16 checkpoint: FP8's activation rounding adds ~3%
    of its own. (Per-token losses of 8 x 256-token completions through an FP8 model: 12% off with 4.8% of the
    entries zero unscaled, 3.0% and none scaled, bf16 3.8%.)"""
    from fp8kit.rl.rollout import Completion, HFRollout

    ids = torch.randint(3, 300, (32, 24), generator=torch.Generator().manual_seed(0)).tolist()

    class Fixed(HFRollout):
        def generate(self, prompt_ids, n, *args, **kwargs):
            return [Completion(ids[i], [-5.0] * len(ids[i])) for i in range(len(prompt_ids) * n)]

    grads, scales = {}, {}
    for dtype in (torch.float32, torch.float16):
        model, tok = load_model(str(tiny_llama), load_in_fp8=False, lora_rank=4, dtype=dtype, device="cpu", seed=1)
        with torch.no_grad():
            for i, m in enumerate(lora_modules(model).values()):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        stepped = _record_stepped_gradients(monkeypatch)
        config = GRPOConfig(steps=1, prompts_per_step=4, num_generations=8, max_completion_length=24, seed=5,
                            gradient_checkpointing=False, gradient_accumulation_steps=8)
        step = train(model, tok, ["the quick", "lazy dog", "brown fox", "jumps over"],
                     lambda completion_ids, **_: [sum(c) / 3000 for c in completion_ids], config,
                     rollout=Fixed(model, tok))[0]
        grads[dtype], scales[dtype] = dict(zip(names, stepped)), step.get("loss_scale", 1.0)
    assert "loss_scale" not in step or scales[torch.float16] == 2.0 ** 16
    ref, got = grads[torch.float32], grads[torch.float16]  # the masters' gradients, unscaled
    err = sum(float((got[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5 / sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    zeros = sum(int(((got[n] == 0) & (ref[n] != 0)).sum()) for n in ref) / sum(ref[n].numel() for n in ref)
    assert err < 0.003 and zeros < 1e-4, (err, zeros)


def test_float16_checkpoint_keeps_the_loss_scale(tiny_fp8, tmp_path):
    """The loss scale (and its growth count) is part of a float16 run's state: a resumed run uses the saved one."""
    def reward(completions, **_):
        return [len(c) / 40 for c in completions]

    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=6,
                        output_dir=str(tmp_path / "run"), save_steps=1)
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float16, device="cpu")
    first = train(model, tok, ["the quick", "lazy dog"], reward, config)[0]
    assert first["loss_scale"] == 2.0 ** 16
    state_file = tmp_path / "run" / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["grad_scaler"]["scale"] == 2.0 ** 16 and state["grad_scaler"]["_growth_tracker"] == 1
    state["grad_scaler"]["scale"] = 1024.0  # what a run that had overflowed six times would have saved
    state_file.write_text(json.dumps(state))
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float16, device="cpu")
    resumed = train(model, tok, ["the quick", "lazy dog"], reward, GRPOConfig(**{**config.__dict__, "steps": 2}),
                    resume_from=tmp_path / "run" / "checkpoint-1")
    assert [h["step"] for h in resumed] == [2] and resumed[0]["loss_scale"] == 1024.0
    bf16, _ = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.bfloat16, device="cpu")
    assert "loss_scale" not in train(bf16, tok, ["the quick"], reward, GRPOConfig(steps=1, prompts_per_step=1,
                                                                                  num_generations=2,
                                                                                  max_completion_length=4))[0]


def test_float16_overflow_skips_the_step_and_halves_the_scale(tiny_fp8, monkeypatch):
    """A loss scale too large for float16 (2^100 here) overflows: each such step leaves the adapter and AdamW's
    state as they were and halves the scale for the next."""
    import functools

    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 100))
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float16, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    history = train(model, tok, ["the quick", "lazy dog"], lambda completions, **_: [len(c) / 40 for c in completions],
                    GRPOConfig(steps=3, prompts_per_step=2, num_generations=4, max_completion_length=6))
    assert [h["loss_scale"] for h in history] == [2.0 ** 100, 2.0 ** 99, 2.0 ** 98]
    assert all(h["update_skipped"] and not math.isfinite(h["grad_norm"]) for h in history)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_top_p_rollout_and_trainer_score_the_same_nucleus(tiny_fp8):
    """With top_p < 1 the engines report log-probabilities renormalized over the nucleus they sampled from (vLLM's
    processed_logprobs), and so does the trainer: importance weights then carry the engines' mismatch, not the
    nucleus mass (over the full vocabulary they would average about top_p)."""
    from fp8kit.rl.grpo import _batch, completion_logprobs
    from fp8kit.rl.rollout import HFRollout

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    prompts = [tok("the quick")["input_ids"], tok("lazy dog jumps")["input_ids"]]
    completions = HFRollout(model, tok).generate(prompts, 4, 8, temperature=0.9, top_p=0.5, seed=3)
    batch = _batch(prompts, completions, 4, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        nucleus = completion_logprobs(model, batch, slice(0, 8), 0.9, top_p=0.5)
        full = completion_logprobs(model, batch, slice(0, 8), 0.9)
    mask = batch["mask"].bool()
    rollout = batch["rollout_logp"]
    assert (rollout - nucleus)[mask].abs().max() < 1e-5
    assert ((nucleus - full)[mask] >= -1e-6).all() and (nucleus - full)[mask].max() > 0.1  # renormalized upward
    history = train(model, tok, ["the quick", "lazy dog jumps"], lambda completions, **_: [len(c) / 40 for c in completions],
                    GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=8,
                               temperature=0.9, top_p=0.5))
    assert history[0]["mismatch_kl"] < 1e-6 and history[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_batch_rounded_to_a_multiple_pads_on_the_left_and_scores_the_same(tiny_fp8):
    """The trainer with compiled layers rounds a step's width up to a multiple of 8 (the compiled attention guards on
    it): the extra columns are padding before the prompts, so completions, masks and the trainer's
    log-probabilities are the unrounded batch's, to float32 accumulation order."""
    from fp8kit.rl.grpo import _batch, completion_logprobs
    from fp8kit.rl.rollout import Completion

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    prompts = [tok("the quick")["input_ids"], tok("lazy dog jumps")["input_ids"]]
    ids = torch.randint(3, 500, (4, 6), generator=torch.Generator().manual_seed(0)).tolist()
    completions = [Completion(ids[i][:k], [-1.5] * k) for i, k in enumerate((6, 2, 4, 5))]
    plain = _batch(prompts, completions, 2, tok.pad_token_id, torch.device("cpu"))
    rounded = _batch(prompts, completions, 2, tok.pad_token_id, torch.device("cpu"), multiple=8)
    extra = rounded["input_ids"].shape[1] - plain["input_ids"].shape[1]
    assert rounded["input_ids"].shape[1] % 8 == 0 and 0 <= extra < 8
    assert plain["input_ids"].shape[1] % 8 != 0  # else this test checks nothing
    assert (rounded["attention_mask"][:, :extra] == 0).all()
    assert (rounded["input_ids"][:, :extra] == tok.pad_token_id).all()
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(rounded[key][:, extra:], plain[key]), key
    for key in ("completion_ids", "mask", "rollout_logp"):
        assert torch.equal(rounded[key], plain[key]), key
    with torch.no_grad():
        got = completion_logprobs(model, rounded, slice(0, 4), 1.0)
        want = completion_logprobs(model, plain, slice(0, 4), 1.0)
    torch.testing.assert_close(got * plain["mask"], want * plain["mask"], rtol=1e-5, atol=1e-5)


def test_reward_functions_get_every_column_at_every_step(tiny_fp8):
    """Dict prompts whose keys differ: each step passes every column any row has (None where a row lacks it),
    paired with its own completions, whichever row the step drew first."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    rows = [{"prompt": "the quick", "answer": "fox"}, {"prompt": "lazy dog"}, {"prompt": "brown fox", "tag": 3}]
    seen = []

    def reward(prompts, completions, answer, tag, **_):
        seen.append(list(zip(prompts, answer, tag)))
        return [0.0] * len(completions)

    train(model, tok, rows, reward, GRPOConfig(steps=4, prompts_per_step=2, num_generations=2,
                                               max_completion_length=2))
    want = {"the quick": ("fox", None), "lazy dog": (None, None), "brown fox": (None, 3)}
    assert len(seen) == 4 and all(want[p] == (a, t) for step in seen for p, a, t in step)


def test_loss_type_defaults_follow_the_loss_type():
    """epsilon_high and scale_rewards were resolved from loss_type in __post_init__: dataclasses.replace(GRPOConfig(),
    loss_type="dapo") kept epsilon_high 0.2, and replace(GRPOConfig(loss_type="dapo"), loss_type="grpo") kept 0.28.
    Unset, they follow the current loss_type (and epsilon); set, they stand whatever the loss type."""
    from dataclasses import replace

    from fp8kit.rl.grpo_loss import LOSS_TYPES

    base = GRPOConfig()
    assert base.epsilon_high is None and base.scale_rewards is None
    dapo, dr = replace(base, loss_type="dapo"), replace(base, loss_type="dr_grpo")
    assert (dapo.effective_epsilon_high, dapo.effective_scale_rewards) == (0.28, "group")
    assert (dr.effective_epsilon_high, dr.effective_scale_rewards) == (0.2, "none")
    for back in (replace(GRPOConfig(loss_type="dapo"), loss_type="grpo"), replace(dr, loss_type="grpo")):
        assert (back.effective_epsilon_high, back.effective_scale_rewards) == (0.2, "group")
    assert replace(base, epsilon=0.1).effective_epsilon_high == 0.1
    assert replace(dapo, epsilon=0.1).effective_epsilon_high == 0.28
    for explicit in (GRPOConfig(epsilon_high=0.3, scale_rewards="batch"), GRPOConfig(epsilon_high=0.0,
                                                                                      scale_rewards=False)):
        for loss_type in LOSS_TYPES:
            moved = replace(explicit, loss_type=loss_type)
            assert (moved.epsilon_high, moved.scale_rewards) == (explicit.epsilon_high, explicit.scale_rewards)
            assert (moved.effective_epsilon_high, moved.effective_scale_rewards) == (
                explicit.epsilon_high, explicit.scale_rewards)
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"  # a bool is stored as TRL's string
    config = GRPOConfig()
    config.loss_type = "dr_grpo"  # an attribute set after construction is followed too
    assert config.effective_scale_rewards == "none"
    config.scale_rewards = True
    assert config.effective_scale_rewards == "group"


def test_train_uses_and_checkpoints_the_loss_types_defaults(tiny_fp8, tmp_path, monkeypatch):
    """The loss and the advantages get the values of the config's current loss_type; the checkpoint keeps the fields
    as set (None: by loss type, so the saved config still follows a later loss_type) and records the values used."""
    from dataclasses import replace

    from fp8kit.rl import grpo

    seen = []
    loss, advantages = grpo.policy_loss, grpo.group_advantages
    monkeypatch.setattr(grpo, "policy_loss", lambda *a, **k: seen.append(("epsilon_high", a[6])) or loss(*a, **k))
    monkeypatch.setattr(grpo, "group_advantages",
                        lambda *a, **k: seen.append(("scale_rewards", k["scale_rewards"])) or advantages(*a, **k))
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    base = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for loss_type, epsilon_high, scale in (("dapo", 0.28, "group"), ("dr_grpo", 0.2, "none")):
        seen.clear()
        config = replace(base, loss_type=loss_type, output_dir=str(tmp_path / loss_type), save_steps=1)
        train(model, tok, ["the quick"], lambda completions, **_: [len(c) for c in completions], config)
        assert seen == [("scale_rewards", scale), ("epsilon_high", epsilon_high)], seen
        state = json.loads((tmp_path / loss_type / "checkpoint-1" / "trainer_state.json").read_text())
        assert state["config"]["epsilon_high"] is None and state["config"]["scale_rewards"] is None
        assert state["effective"] == {"epsilon_high": epsilon_high, "scale_rewards": scale}
        saved = GRPOConfig(**state["config"])
        assert saved == config
        assert replace(saved, loss_type="grpo").effective_epsilon_high == 0.2


def _llama3_style(tok):
    """The tiny tokenizer made to behave as Llama 3's or Gemma 3's: it adds BOS itself, and its chat template
    begins with {{ bos_token }}."""
    from tokenizers.processors import TemplateProcessing

    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    assert tok("the quick")["input_ids"][0] == tok.bos_token_id
    return tok


def test_chat_prompts_reach_the_engine_and_the_trainer_with_one_bos(tiny_fp8, monkeypatch):
    """A prompt made with apply_chat_template(tokenize=False) already begins with BOS: tokenized again with special
    tokens on, the rollout and the trainer saw <s><s>. Text that begins with bos_token is now taken as it is, plain
    text still gets the tokenizer's BOS, and a conversation goes through the chat template: each reaches the engine
    and the trainer with one BOS, and the max_seq_length check counts it once."""
    from fp8kit.rl import grpo
    from fp8kit.rl.rollout import HFRollout

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    tok, bos = _llama3_style(tok), tok.bos_token_id
    messages = [{"role": "user", "content": "the quick fox"}]
    templated = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert templated.startswith(tok.bos_token) and tok(templated)["input_ids"][:2] == [bos, bos]  # the bug's input
    chat_ids = tok(templated, add_special_tokens=False)["input_ids"]
    text_ids = [bos, *tok("the quick fox", add_special_tokens=False)["input_ids"]]
    assert chat_ids[:2] != [bos, bos]

    engine, trainer, rewarded = [], [], []

    class Spy(HFRollout):
        def generate(self, prompt_ids, *args, **kwargs):
            engine.extend(prompt_ids)
            return super().generate(prompt_ids, *args, **kwargs)

    batch = grpo._batch
    monkeypatch.setattr(grpo, "_batch",
                        lambda prompt_ids, *a, **kw: trainer.extend(prompt_ids) or batch(prompt_ids, *a, **kw))

    def reward(prompts, completions, **_):
        rewarded.append((prompts[0], completions[0]))
        return [0.0] * len(completions)

    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=3)
    for prompts, want in (([templated], chat_ids), ([messages], chat_ids), ([{"prompt": messages}], chat_ids),
                          (["the quick fox"], text_ids)):
        engine.clear(), trainer.clear(), rewarded.clear()
        train(model, tok, prompts, reward, config, rollout=Spy(model, tok))
        assert engine == [want] and trainer == [want], (prompts, engine, trainer)
        prompt, completion = rewarded[0]
        if isinstance(prompts[0], str):
            assert prompt == prompts[0] and isinstance(completion, str)
        else:  # TRL's conversational convention: the messages, and each completion as an assistant message
            assert prompt == messages and completion == [{"role": "assistant", "content": completion[0]["content"]}]
            assert isinstance(completion[0]["content"], str)
    model.max_seq_length = len(chat_ids) + 1  # room for one completion token: accepted
    train(model, tok, [templated], reward, config)
    model.max_seq_length = len(chat_ids)
    for prompts in ([templated], [messages]):
        with pytest.raises(Fp8kitError, match=f"prompt 0 has {len(chat_ids)} tokens, and max_seq_length"):
            train(model, tok, prompts, reward, config)


def test_a_fresh_run_syncs_the_adapter_before_its_first_rollout(tiny_fp8):
    """The rollout engine got its copy of the adapter when the model was built (B zero, for vLLM); an adapter set
    since (a warm start) reached it only after step 1's update, so step 1 sampled from another policy than the one
    scored. train() syncs first, fresh or resumed."""
    from fp8kit.rl.rollout import HFRollout

    calls = []

    class Recording(HFRollout):
        def sync_lora(self, model):
            calls.append(("sync", max(m.lora_B.abs().max().item() for m in lora_modules(model).values())))

        def generate(self, *args, **kwargs):
            calls.append(("generate", None))
            return super().generate(*args, **kwargs)

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    with torch.no_grad():  # a warm start
        for m in lora_modules(model).values():
            m.lora_B.fill_(0.01)
    train(model, tok, ["the quick", "lazy dog"], [lambda completions, **_: [len(c) / 10 for c in completions]],
          GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4, seed=0),
          rollout=Recording(model, tok))
    assert calls[0] == ("sync", pytest.approx(0.01)) and calls[1][0] == "generate", calls


def test_vllm_rollouts_refuse_lm_head_lora_and_unchecked_multimodal_models_before_starting(tiny_fp8, tmp_path,
                                                                                           monkeypatch):
    """With vLLM rollouts (faked here: a CUDA device and vLLM installed), LoRA on lm_head (vLLM's lm_head LoRA has
    no per-slice stacks: the first sync failed after a whole step) and a multimodal model other than Gemma 3 (vLLM's
    names for Qwen2.5-VL's language model do not rename to the trainer's; Mistral 3 does not import in vLLM 0.25)
    are one line before any engine starts."""
    from fp8kit.rl import loader
    from fp8kit.rl import model as rl_model

    for module in (rl_model, loader):
        monkeypatch.setattr(module, "check_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    with pytest.raises(Fp8kitError, match="vLLM rollouts carry no LoRA on lm_head"):
        load_model(str(tiny_fp8), lora_rank=8, target_modules=["q_proj", "lm_head"])
    src = build_checkpoint(tmp_path / "src", "mistral3", torch.bfloat16, seed=1)
    out = convert(src, tmp_path / "fp8", scheme="dynamic").out
    add_tokenizer(out, "the quick brown fox " * 20, vocab_size=300)
    with pytest.raises(Fp8kitError, match="Mistral3ForConditionalGeneration has a vision or audio tower.*"
                                          "Gemma3ForConditionalGeneration so far.*fast_inference=False"):
        load_model(out, lora_rank=8)
    add_tokenizer(src, "the quick brown fox " * 20, vocab_size=300)  # the original: refused before its conversion
    monkeypatch.setattr(rl_model, "_checkpoint", lambda *a: pytest.fail("converted before refusing"))
    with pytest.raises(Fp8kitError, match="src: Mistral3ForConditionalGeneration has a vision or audio tower"):
        load_model(str(src), lora_rank=8)


@pytest.mark.parametrize("arch", ["gemma3_mm", "mistral3"])
def test_multimodal_rollouts_run_vllm_language_only_and_the_trainer_reads_the_towers_once(tmp_path, tiny_fp8, arch):
    """vLLM builds no tower for text rollouts (language_model_only); the trainer takes exactly the checkpoint's
    tower and projector tensors from the files, and vLLM's module names (the checkpoint's
    `language_model.model.layers.N`) reach the trainer's LoRA modules (`model.language_model.layers.N`)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from fp8kit.loaded_names import key_renamer
    from fp8kit.rl.loader import load_fp8_model, lora_modules
    from fp8kit.rl.vllm_engine import rollout_llm_kwargs, tower_tensors

    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=1)
    out = convert(src, tmp_path / "fp8", scheme="dynamic").out
    kwargs = rollout_llm_kwargs(out, torch.bfloat16, 256, 0.5, 8, None, {})
    assert kwargs["language_model_only"] is True
    assert "language_model_only" not in rollout_llm_kwargs(tiny_fp8, torch.bfloat16, 256, 0.5, 8, None, {})
    towers = tower_tensors(out, AutoConfig.from_pretrained(out), torch.device("cpu"))
    names = set()
    for f in Path(out).glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            names |= set(sf.keys())
    assert set(towers) == {k for k in names if "vision_tower" in k or "multi_modal_projector" in k} and towers
    assert all(not k.startswith(("model.language_model.", "language_model.", "lm_head")) for k in towers)
    assert tower_tensors(tiny_fp8, AutoConfig.from_pretrained(tiny_fp8), torch.device("cpu")) == {}
    model = load_fp8_model(out, torch.float32, lora_rank=8)
    rename, ours = key_renamer(model), lora_modules(model)
    vllm_subs = [f"language_model.model.layers.{i}.{part}" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    assert sorted(rename(n) for n in vllm_subs) == sorted(ours)


def test_reward_metrics_are_trls_and_two_lambdas_keep_their_own(tiny_fp8):
    """As TRL (f2cd577) logs them: reward_std is the std of the batch's rewards, frac_reward_zero_std the share of
    completions whose scaling std (their group's; the batch's for scale_rewards="batch") is 0; two reward
    functions of one name were logged under one key, the second overwriting the first."""
    model, tokenizer = load_model(str(tiny_fp8), lora_rank=4, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=4, seed=0)
    constant = lambda prompts, completions, **kw: [1.0] * len(completions)  # noqa: E731
    lengths = lambda prompts, completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    seen = {}

    def spy(prompts, completions, **kw):
        seen["rewards"] = [1.0 + float(len(c)) for c in completions]
        return [0.0] * len(completions)

    [m] = train(model, tokenizer, ["a b", "c d e"], [constant, lengths, spy], config)
    assert m["reward/<lambda>"] == 1.0 and m["reward/<lambda>_1"] == pytest.approx(
        sum(seen["rewards"]) / len(seen["rewards"]) - 1.0)
    groups = torch.tensor(seen["rewards"]).view(2, 4)
    assert m["reward_std"] == pytest.approx(groups.std().item())
    assert m["frac_reward_zero_std"] == pytest.approx(
        torch.isclose(groups.std(dim=1), torch.zeros(2)).float().mean().item())
    # two groups of equal rewards, 1s and 0s, and one unscored completion: under "batch" scaling they do get
    # advantages (the batch's std is not 0), and the unscored one is out of the mean and std
    pattern = [1.0, 1.0, 1.0, None, 0.0, 0.0, 0.0, 0.0]
    batch = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=4, seed=0,
                       scale_rewards="batch")
    [m] = train(model, tokenizer, ["a b", "c d e"], [lambda completions, **kw: pattern], batch)
    assert m["reward_mean"] == pytest.approx(3 / 7) and m["frac_reward_zero_std"] == 0.0
    assert m["reward_std"] == pytest.approx(torch.tensor([1.0] * 3 + [0.0] * 4).std().item())
    [m] = train(model, tokenizer, ["a b", "c d e"], [lambda completions, **kw: pattern], config)
    assert m["frac_reward_zero_std"] == 1.0


def test_output_dir_that_cannot_be_written_and_a_bad_on_step_fail_before_the_first_step(tiny_fp8, tmp_path,
                                                                                         monkeypatch):
    model, tokenizer = load_model(str(tiny_fp8), lora_rank=4, device="cpu")
    blocker = tmp_path / "ro"
    blocker.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != blocker / "run")
    rollouts = []
    monkeypatch.setattr("fp8kit.rl.grpo.HFRollout.generate", lambda *a, **k: rollouts.append(1))
    config = GRPOConfig(steps=2, prompts_per_step=1, num_generations=2, max_completion_length=4,
                        output_dir=str(blocker / "run"), save_steps=1)
    with pytest.raises(Fp8kitError, match=r"output_dir=.*run'?: cannot write checkpoints there"):
        train(model, tokenizer, ["a b"], [lambda prompts, completions, **kw: [0.0] * len(completions)], config)
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=4)
    with pytest.raises(Fp8kitError, match="on_step='print': expected a function"):
        train(model, tokenizer, ["a b"], [lambda prompts, completions, **kw: [0.0] * len(completions)], config,
              on_step="print")
    assert rollouts == []


def test_checkpoint_files_reach_the_disk_before_the_rename(tiny_fp8, tmp_path, monkeypatch):
    """optimizer.safetensors and trainer_state.json were not fsynced: after a power loss checkpoint-N could exist with
    empty files, and a resume from output_dir would fail on it."""
    import fp8kit.rl.grpo as grpo

    synced, real = [], grpo._fsync
    monkeypatch.setattr(grpo, "_fsync", lambda path: (synced.append(Path(path).name), real(path)))
    model, tokenizer = load_model(str(tiny_fp8), lora_rank=4, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=3,
                        output_dir=str(tmp_path / "run"), save_steps=1)
    train(model, tokenizer, ["a b"], [lambda prompts, completions, **kw: [0.0] * len(completions)], config)
    assert {"optimizer.safetensors", "trainer_state.json"} <= set(synced)
    assert (tmp_path / "run" / "checkpoint-1" / "trainer_state.json").is_file()


def test_compiled_decoder_layers_train_the_step_eager_layers_train(tiny_fp8):
    """GRPOConfig.torch_compile: the decoder layers run compiled in the trainer's passes only (the rollout sees them
    eager, and after the run they are as before), checkpointed reentrant (eager: non-reentrant), and the step (uneven
    micro-batches: two shapes; beta's adapters-off reference pass) computes what the eager step does, to float32
    accumulation order."""
    from torch._dynamo.utils import counters

    from fp8kit.rl.regional_compile import decoder_layers

    torch._dynamo.reset()  # graphs an earlier test compiled for these layers would be reused, not counted
    seen, reentrant = [], []
    logged = []
    for compiled in (False, True):
        model, tok = _seeded_lora_model(tiny_fp8, torch.float32)
        layers = decoder_layers(model)
        Fixed = _fixed_rollout([6, 1, 4, 3, 3, 6, 2, 5])

        class Watched(Fixed):
            def generate(self, *args, **kwargs):
                seen.append([m._compiled_call_impl for m in layers])
                reentrant.append({m._gradient_checkpointing_func.keywords["use_reentrant"] for m in layers})
                return super().generate(*args, **kwargs)

        config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=4, max_completion_length=6, seed=5,
                            gradient_accumulation_steps=3, beta=0.04, torch_compile=compiled)
        if compiled:  # the caller's own checkpointing, non-reentrant: the compiled run leaves it so
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        graphs = counters["stats"]["unique_graphs"]
        with warnings.catch_warnings():  # beta's no-grad reference pass through reentrant checkpoints says nothing
            warnings.filterwarnings("error", "None of the inputs have requires_grad", UserWarning)
            logged.append(train(model, tok, ["the quick", "lazy dog"], [_sum_reward], config,
                                rollout=Watched(model, tok))[0])
        assert (counters["stats"]["unique_graphs"] > graphs) is compiled
        assert layers and all(m._compiled_call_impl is None for m in layers)
        assert model.is_gradient_checkpointing is compiled
        if compiled:
            assert {m._gradient_checkpointing_func.keywords["use_reentrant"] for m in layers} == {False}
    assert seen == [[None] * len(layers)] * 2
    assert reentrant == [{False}, {True}]
    eager, comp = logged
    assert eager["grad_norm"] > 0 and eager["kl"] > 0
    for key in ("loss", "grad_norm", "kl", "mismatch_kl", "is_weight_mean"):
        assert comp[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-7), key


def test_reentrant_checkpointing_only_where_the_input_embeddings_are_hooked(tiny_fp8, monkeypatch):
    """Reentrant checkpointing gives the LoRA parameters no gradient unless the layers' input requires grad:
    without a hook this enabling put on the input embeddings (none found, or hooks left from an earlier enabling
    only) the trainer checkpoints non-reentrant, and adds no hook."""
    from fp8kit.rl.grpo import _set_gradient_checkpointing
    from fp8kit.rl.regional_compile import decoder_layers

    def modes(model):
        return {m._gradient_checkpointing_func.keywords["use_reentrant"] for m in decoder_layers(model)}

    model, _ = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    _set_gradient_checkpointing(model, True, reentrant=True)
    assert modes(model) == {True} and len(model._require_grads_hooks) == 1
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, use_cache=False).logits.pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    model.gradient_checkpointing_disable()
    model._require_grads_hooks[0].remove()

    model, _ = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    # as transformers' enable_input_require_grads does where it finds no input embeddings to hook
    monkeypatch.setattr(model, "enable_input_require_grads", lambda: setattr(model, "_require_grads_hooks", []))
    _set_gradient_checkpointing(model, True, reentrant=True)
    assert modes(model) == {False} and not model._require_grads_hooks
    stale = model._require_grads_hooks = [torch.nn.Identity().register_forward_hook(lambda *a: None)]
    monkeypatch.setattr(model, "enable_input_require_grads", lambda: None)  # as for inputs other than input_ids
    _set_gradient_checkpointing(model, True, reentrant=True)
    assert modes(model) == {False} and model._require_grads_hooks is stale


def test_compiled_decoder_layers_restore_what_the_layers_had(tiny_fp8):
    """A layer the caller compiled (nn.Module.compile) gets its own compiled call back, an eager one stays eager, and
    the context is a no-op when off or for a model without decoder layers."""
    from fp8kit.rl.regional_compile import compiled_decoder_layers, decoder_layers

    model, _ = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    layers[0].compile()
    own = layers[0]._compiled_call_impl
    with compiled_decoder_layers(model, enabled=False):
        assert layers[0]._compiled_call_impl is own and layers[1]._compiled_call_impl is None
    with compiled_decoder_layers(model):
        assert all(m._compiled_call_impl not in (None, own) for m in layers)
    assert layers[0]._compiled_call_impl is own and all(m._compiled_call_impl is None for m in layers[1:])
    with compiled_decoder_layers(torch.nn.Linear(2, 2)):
        pass


def test_compiled_layers_share_one_graph_whatever_the_depth(tmp_path, monkeypatch):
    """FP8 layers (their MLPs fused) compile the same graphs whatever their number: two, for the first layer, whose
    input needs no gradient, and for the others; dynamo guarded on each fused MLP forward's identity, one graph a
    layer. Counted with the aot_eager backend (no code generation), without a KV cache as the trainer runs."""
    from torch._dynamo.utils import counters

    from fp8kit import convert
    from fp8kit.rl import load_fp8_model, regional_compile
    from fp8kit.rl.fp8_mlp import _FusedForward

    monkeypatch.setattr(regional_compile, "_compiled_call",
                        lambda: torch.compile(regional_compile._call_layer, backend="aot_eager"))
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=3, num_hidden_layers=4)
    model = load_fp8_model(convert(src, tmp_path / "fp8", scheme="dynamic").out, dtype=torch.float32, lora_rank=4)
    mlps = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), _FusedForward)]
    assert len(mlps) == 4
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    want = model(input_ids=ids, use_cache=False).logits
    with regional_compile.compiled_decoder_layers(model):
        got = model(input_ids=ids, use_cache=False).logits
        assert not any("forward" in m.__dict__ for m in mlps)  # set aside while compiled
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert all(isinstance(m.__dict__.get("forward"), _FusedForward) for m in mlps)  # and back
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_layers_compile_once_for_batches_of_every_width(tmp_path, monkeypatch, arch):
    """GRPO's batches change width each step, padded on the left: the layers compile one graph per pass (the first
    layer's and the others') with a dynamic length, where dynamo's default (dynamic_length=False) compiles a static
    graph and again at the first new width. Gemma 3's sliding-window layers take lengths past the window. Forward
    and input gradients as eager's."""
    from torch._dynamo.utils import counters

    from fp8kit import convert
    from fp8kit.rl import load_fp8_model, regional_compile

    monkeypatch.setattr(regional_compile, "_compiled_call",
                        lambda: torch.compile(regional_compile._call_layer, backend="aot_eager"))
    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=3, num_hidden_layers=2)
    model = load_fp8_model(convert(src, tmp_path / "fp8", scheme="dynamic").out, dtype=torch.float32, lora_rank=4)
    lora = [p for p in model.parameters() if p.requires_grad]

    def step(length):
        ids = torch.randint(0, 512, (3, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                       use_cache=False).logits
        grads = torch.autograd.grad(logits.pow(2).mean(), lora)
        return logits, grads

    for dynamic_length, graphs in ((True, [2, 2, 2]), (False, [2, 4, 4])):
        torch._dynamo.reset()
        counters.clear()
        seen = []
        for length in (9, 13, 70):
            want = step(length)
            with regional_compile.compiled_decoder_layers(model, dynamic_length=dynamic_length):
                got = step(length)
            seen.append(counters["stats"]["unique_graphs"])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert seen == graphs, (dynamic_length, dict(counters["stats"]))


def test_a_batch_without_padding_reuses_the_padded_batches_compiled_graph(tiny_fp8, monkeypatch):
    """transformers gives the layers no mask for a batch with no padding (sdpa's is_causal), a graph of its own: the
    trainer's rounded batches always carry padding, so a step whose rows are all full compiles nothing more, and
    scores as the unpadded batch does."""
    from torch._dynamo.utils import counters

    from fp8kit.rl import regional_compile
    from fp8kit.rl.grpo import _batch, completion_logprobs
    from fp8kit.rl.rollout import Completion

    monkeypatch.setattr(regional_compile, "_compiled_call",
                        lambda: torch.compile(regional_compile._call_layer, backend="aot_eager"))
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (5,), generator=gen).tolist()
    ids = torch.randint(3, 500, (2, 11), generator=gen).tolist()
    padded = _batch([prompt], [Completion(ids[0][:7], [-1.0] * 7), Completion(ids[1][:3], [-1.0] * 3)], 2,
                    tok.pad_token_id, torch.device("cpu"), multiple=8)
    rows = [Completion(ids[0], [-1.0] * 11), Completion(ids[1], [-1.0] * 11)]  # 5 + 11 = 16: nothing to round
    full = _batch([prompt], rows, 2, tok.pad_token_id, torch.device("cpu"), multiple=8)
    plain = _batch([prompt], rows, 2, tok.pad_token_id, torch.device("cpu"))
    assert bool(plain["attention_mask"].all())  # else this test checks nothing
    assert full["input_ids"].shape[1] == 24 and not bool(full["attention_mask"].all())
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with torch.no_grad(), regional_compile.compiled_decoder_layers(model):
        completion_logprobs(model, padded, slice(0, 2), 1.0)
        graphs.append(counters["stats"]["unique_graphs"])
        got = completion_logprobs(model, full, slice(0, 2), 1.0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0], (graphs, dict(counters["stats"]))
    with torch.no_grad():
        want = completion_logprobs(model, plain, slice(0, 2), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_compile_needs_decoder_layers_and_a_recent_torch(tiny_fp8, monkeypatch):
    """Refused before the first rollout, one line each."""
    from fp8kit.rl import regional_compile

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2, torch_compile=True)

    class NoLayers(torch.nn.Module):
        pass

    with pytest.raises(Fp8kitError, match="NoLayers has no transformers decoder layers"):
        regional_compile.check_torch_compile(NoLayers())
    monkeypatch.delattr(torch._dynamo.config, "recompile_limit", raising=False)

    def fail(*args, **kwargs):
        raise AssertionError("generated before the refusal")

    with pytest.raises(Fp8kitError, match=r"torch_compile=True needs torch 2\.7 or later") as e:
        train(model, tok, ["the quick"], [_sum_reward], config, rollout=type("R", (), {
            "generate": fail, "sleep": fail, "wake": fail, "sync_lora": fail})())
    assert "\n" not in str(e.value)
