"""Bad GRPO input refused in one Fp8kitError line before training starts (each was accepted, then failed or
silently did nothing mid-run), and the toy script's refusals before it builds anything."""

import functools
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kit import convert
from fp8kit.errors import Fp8kitError
from fp8kit.models import add_tokenizer, build_checkpoint
from fp8kit.rl.grpo import GRPOConfig, train
from fp8kit.rl.model import load_model

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "evals" / "grpo_toy.py"


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """A tiny FP8 Llama whose tokenizer adds no BOS token (the empty string has no tokens)."""
    src = build_checkpoint(tmp_path_factory.mktemp("grpo-errors") / "llama", "llama", torch.bfloat16, seed=3)
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 50, vocab_size=300)
    return convert(src, src.parent / "llama-fp8", scheme="dynamic").out


def _zero(completions, **_):
    return [0.0] * len(completions)


def test_output_dir_as_a_path_is_kept_as_a_string_and_checkpoints(tiny_fp8, tmp_path):
    """A pathlib.Path was accepted, then json.dumps of the config failed at the first checkpoint."""
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2,
                        output_dir=tmp_path / "run", save_steps=1)
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    train(model, tok, ["the quick"], [_zero], config)
    assert config.output_dir == str(tmp_path / "run")
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["config"]["output_dir"] == str(tmp_path / "run")
    with pytest.raises(Fp8kitError) as e:
        GRPOConfig(output_dir=3)
    assert str(e.value).startswith("output_dir=3:") and "\n" not in str(e.value)


def test_output_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """'~/runs' made a folder literally named '~' in the working directory, as transformers' TrainingArguments
    does not."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert GRPOConfig(output_dir="~/runs").output_dir == str(tmp_path / "home" / "runs")


@pytest.mark.parametrize("value", [1.0, [float("nan")], [float("inf")], [True], ["1"], [1.0, None]],
                         ids=["not-a-list", "nan", "inf", "bool", "string", "none"])
def test_reward_weights_must_be_a_list_of_finite_numbers(value):
    """1.0 gave a raw TypeError; NaN or inf weights made every advantage NaN and every update was skipped."""
    with pytest.raises(Fp8kitError) as e:
        GRPOConfig(reward_weights=value)
    assert str(e.value).startswith(f"reward_weights={value!r}:") and "\n" not in str(e.value), e.value
    assert "one per reward function" in str(e.value)


def test_reward_weights_as_a_tuple_are_accepted():
    assert GRPOConfig(reward_weights=(1, 0.5)).reward_weights == [1.0, 0.5]


def test_prompt_without_tokens_is_refused_before_training(tiny_fp8):
    """The empty string (no BOS added) reached generate and failed with a raw IndexError."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    assert tok("")["input_ids"] == []
    calls = []

    def reward(completions, **_):
        calls.append(1)
        return [0.0] * len(completions)

    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for prompts, index in (([""], 0), (["the quick", "", "lazy dog"], 1)):
        with pytest.raises(Fp8kitError) as e:
            train(model, tok, prompts, [reward], config)
        assert str(e.value).startswith(f"prompt {index} ") and "\n" not in str(e.value), e.value
    model.max_seq_length = None  # checked also without a length limit
    with pytest.raises(Fp8kitError, match="prompt 0 "):
        train(model, tok, [{"prompt": ""}], [reward], config)
    assert not calls  # refused before any rollout


def test_toy_script_refuses_vllm_with_float32_off_cuda_or_without_vllm_before_building_anything(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(tmp_path / "toy"), "--vllm", "--dtype",
                           "float32", "--steps", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: ") and "float32" in proc.stderr and "vLLM" in proc.stderr
    assert not (tmp_path / "toy").exists()  # refused before the toy model was pre-trained
    # asked for vLLM on the CPU: it ran all its steps on transformers' generate instead
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(tmp_path / "toy"), "--vllm", "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: --vllm: ") and "--device cuda" in proc.stderr
    assert not (tmp_path / "toy").exists()
    (tmp_path / "afile").write_text("")
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(tmp_path / "afile"), "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and proc.stderr == f"error: --workdir {tmp_path / 'afile'}: a file, not a folder; " \
                                                   f"choose another folder\n", proc.stderr
    # a folder under that file: the OS's reason, in one line
    proc = subprocess.run([sys.executable, str(TOY), "--workdir", str(tmp_path / "afile" / "sub"), "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"error: --workdir {tmp_path / 'afile' / 'sub'}: ") and "Not a directory" in \
        proc.stderr and proc.stderr.endswith("; choose another folder\n"), proc.stderr
    # on a GPU machine without vLLM (made here: CUDA said visible, the vllm import failing), named before any work
    wrapper = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; sys.modules['vllm'] = None; "
               f"sys.argv = [{str(TOY)!r}, *sys.argv[1:]]; runpy.run_path({str(TOY)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", wrapper, "--workdir", str(tmp_path / "toy"), "--vllm", "--device",
                           "cuda", "--steps", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: --vllm: the vllm package does not import here") and \
        "pip install 'fp8kit[gpu]'" in proc.stderr
    assert not (tmp_path / "toy").exists()



def test_a_bare_string_of_prompts_and_no_reward_functions_are_refused(tiny_fp8):
    """A string was iterated into one-character prompts; an empty reward list trained on a reward of 0."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for prompts, funcs, needle in (("the quick", [_zero], "prompts='the quick': expected a list"),
                                   ({"prompt": "the quick"}, [_zero], "wrap a single prompt in a list"),
                                   (["the quick"], [], "reward_funcs=[]: expected a non-empty list"),
                                   (["the quick"], [_zero, "len"], "expected a non-empty list of functions"),
                                   ([{"prompt": "a"}, {"prompt": "b", "completions": 1}], [_zero],
                                    "a row has a 'completions' column, the name of an argument")):
        with pytest.raises(Fp8kitError) as e:
            train(model, tok, prompts, funcs, config)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value
    seen = []

    def reward(completions, **_):  # one function, not in a list, is accepted as TRL accepts it
        seen.extend(completions)
        return [0.0] * len(completions)

    train(model, tok, ["the quick"], reward, config)
    assert len(seen) == 2


@pytest.mark.parametrize("value,stored", [(None, "group"), (True, "group"), ("group", "group"), ("batch", "batch"),
                                          (False, "none"), ("none", "none")])
def test_scale_rewards_takes_trls_values(value, stored):
    """Any truthy value meant the group std: "none" and "batch" divided by it too."""
    assert GRPOConfig(scale_rewards=value).scale_rewards == (None if value is None else stored)  # None: by loss type
    assert GRPOConfig(scale_rewards=value).effective_scale_rewards == stored
    assert GRPOConfig(loss_type="dr_grpo", scale_rewards=value).effective_scale_rewards == (
        "none" if value is None else stored)  # Dr. GRPO's default only; an explicit choice stands


@pytest.mark.parametrize("value", ["std", "False", "Group", 1, 0, [True]])
def test_other_scale_rewards_are_refused(value):
    with pytest.raises(Fp8kitError) as e:
        GRPOConfig(scale_rewards=value)
    assert str(e.value).startswith(f"scale_rewards={value!r}:") and "\n" not in str(e.value), e.value
    assert "'batch'" in str(e.value)


@pytest.mark.parametrize("field", ["importance_sampling", "gradient_checkpointing", "disable_dropout"])
@pytest.mark.parametrize("value", ["false", "False", 0, 1, None])
def test_boolean_fields_must_be_bools(field, value):
    """importance_sampling="false" is truthy: it switched importance sampling on."""
    with pytest.raises(Fp8kitError) as e:
        GRPOConfig(**{field: value})
    assert str(e.value) == f"{field}={value!r}: expected True or False"
    assert getattr(GRPOConfig(**{field: False}), field) is False


def test_output_dir_that_is_a_file_is_refused_up_front(tmp_path):
    """Refused only when the first checkpoint was written, save_steps steps in."""
    (tmp_path / "file").write_text("x")
    for output_dir in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(Fp8kitError) as e:
            GRPOConfig(output_dir=output_dir, save_steps=1)
        assert str(e.value).startswith(f"output_dir={str(output_dir)!r}: {tmp_path / 'file'} exists and is not a "
                                       f"folder") and "\n" not in str(e.value), e.value
    assert GRPOConfig(output_dir=tmp_path / "new" / "run").output_dir == str(tmp_path / "new" / "run")


def test_config_as_none_or_a_dict(tiny_fp8, tmp_path, monkeypatch):
    """train(..., config=None) or a dict failed with a raw AttributeError."""
    from fp8kit.rl import grpo

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    history = train(model, tok, ["the quick"], [_zero],
                    {"steps": 1, "prompts_per_step": 1, "num_generations": 2, "max_completion_length": 2})
    assert len(history) == 1
    seen = []
    monkeypatch.setattr(grpo, "_steps", lambda model, tokenizer, rows, funcs, config, *a: seen.append(config) or [])
    train(model, tok, ["the quick"], [_zero])  # TRL's GRPOTrainer(args=None): the defaults
    assert seen == [GRPOConfig()]
    for config, needle in (({"stepz": 1}, "config: 'stepz' is not a GRPOConfig field"),
                           ({"steps": "1"}, "steps='1': expected an integer >= 1"),
                           ("steps=1", "config='steps=1': expected a GRPOConfig")):
        with pytest.raises(Fp8kitError) as e:
            train(model, tok, ["the quick"], [_zero], config)
        assert str(e.value).startswith(needle) and "\n" not in str(e.value), e.value
    config = GRPOConfig(steps=1, output_dir=tmp_path / "run", save_steps=1)
    (tmp_path / "run").write_text("x")  # output_dir became a file after the config was made
    with pytest.raises(Fp8kitError, match="exists and is not a folder"):
        train(model, tok, ["the quick"], [_zero], config)


@pytest.mark.parametrize("resume_from", [3, 3.0, ["ckpt"]])
def test_resume_from_of_the_wrong_type_is_one_line(tiny_fp8, resume_from):
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    with pytest.raises(Fp8kitError) as e:
        train(model, tok, ["the quick"], [_zero], GRPOConfig(steps=1, num_generations=2), resume_from=resume_from)
    assert str(e.value).startswith(f"resume_from={resume_from!r}: expected a checkpoint") and "\n" not in str(e.value)


def test_reward_values_must_be_numbers(tiny_fp8):
    """A function returning strings such as "1.0" was read as numbers, silently."""
    import numpy as np

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for returned, needle in ((["1.0", "0.0"], "holding str '1.0'"), ([b"1", b"0"], "holding bytes"),
                             ("10", "returned str '10'"), ([torch.ones(2), torch.ones(2)], "tensor of shape (2,)"),
                             ([1 + 2j, 0], "holding complex"), (torch.ones(2, 2), "returned Tensor of shape (2, 2)"),
                             ([np.ones(2), np.ones(2)], "ndarray of shape (2,)")):
        with pytest.raises(Fp8kitError) as e:
            train(model, tok, ["the quick"], [lambda completions, r=returned, **_: r], config)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value
        assert str(e.value).startswith("reward function <lambda> returned"), e.value
    seen = []
    for returned in ([True, 0], [np.float32(0.5), np.int64(1)], [np.bool_(True), None], torch.tensor([0.5, 1.0]),
                     np.array([0.5, 1.0]), [torch.tensor(1.0), torch.tensor(1, dtype=torch.int64)], (0.5, 1),
                     torch.tensor([[0.5], [1.0]]), [np.array(0.5), np.array(1.0)], [torch.tensor([0.5]), torch.ones(1)]):
        history = train(model, tok, ["the quick"], [lambda completions, r=returned, **_: r], config,
                        on_step=seen.append)
        assert len(history) == 1
    assert [m["reward_mean"] for m in seen] == [0.5, 0.75, 1.0, 0.75, 0.75, 1.0, 0.75, 0.75, 0.75, 0.75]  # None: unscored


def test_conversations_that_cannot_be_rendered_are_refused_in_one_line(tiny_fp8):
    """Conversational prompts (TRL's lists of role/content messages) need the tokenizer's chat template; a template
    that raises, a mix of text and conversations, or one conversation passed as the prompt list is one line before
    any rollout."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    assert not tok.chat_template
    calls = []

    def reward(completions, **_):
        calls.append(1)
        return [0.0] * len(completions)

    messages = [{"role": "user", "content": "the quick"}]
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for prompts, start in (([messages], "prompt 0: a conversation needs the tokenizer's chat template"),
                           (["the quick", messages], "prompts: prompt 0 is text and prompt 1 is not"),
                           ([{"prompt": messages}, "lazy dog"], "prompts: prompt 0 is a conversation and prompt 1"),
                           (messages, "prompts: this is one conversation"),
                           ([[{"role": "user"}]], "prompts: expected a non-empty list of strings, of conversations"),
                           ([[]], "prompts: expected a non-empty list")):
        with pytest.raises(Fp8kitError) as e:
            train(model, tok, prompts, [reward], config)
        assert str(e.value).startswith(start) and "\n" not in str(e.value), e.value
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate\nuser/assistant') }}"
    with pytest.raises(Fp8kitError) as e:
        train(model, tok, [messages, messages], [reward], config)
    assert str(e.value) == ("prompt 0: the tokenizer's chat template failed on it (TemplateError: Conversation roles "
                            "must alternate user/assistant)"), e.value
    assert not calls


class _NoRollout:
    """A rollout engine that fails the test if train() gets as far as sampling."""

    def sync_lora(self, model):
        pass

    sleep = wake = lambda self: None

    def generate(self, *args, **kwargs):
        raise AssertionError("train() sampled before refusing its input")


@pytest.mark.parametrize("func,needle", [
    (lambda prompts, completions: [0.0] * len(completions), "unexpected keyword argument 'completion_ids'"),
    (lambda completions: [0.0] * len(completions), "unexpected keyword argument 'prompts'"),
    (lambda prompts, completions, answer, **_: [0.0] * len(completions), "missing a required argument: 'answer'"),
], ids=["no-kwargs", "completions-only", "column-not-in-rows"])
def test_a_reward_function_that_cannot_take_its_arguments_is_one_line_before_the_first_rollout(tiny_fp8, func,
                                                                                                needle):
    """`def f(prompts, completions)` failed with a TypeError after the whole first rollout."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    with pytest.raises(Fp8kitError) as e:
        train(model, tok, ["the quick"], [func], config, rollout=_NoRollout())
    assert needle in str(e.value) and "**kwargs" in str(e.value) and "\n" not in str(e.value), str(e.value)
    score = lambda completion: float(len(completion) > 2)  # noqa: E731 - one completion at a time

    @functools.wraps(score)  # the wrapper is what train() calls: its signature, not score's, counts
    def per_completion(prompts, completions, **_):
        return [score(c) for c in completions]

    train(model, tok, [{"prompt": "the quick", "answer": "fox"}],
          [lambda prompts, completions, answer, **_: [float(a == "fox") for a in answer], per_completion], config)


def test_config_fields_set_after_it_was_built_are_checked_when_training(tiny_fp8):
    """num_generations = 1 on a built config trained with zero advantages (grad_norm 0) and said nothing."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    config.num_generations = 1
    with pytest.raises(Fp8kitError, match=r"num_generations=1: expected an integer >= 2"):
        train(model, tok, ["the quick"], [_zero], config, rollout=_NoRollout())
    config.num_generations, config.save_steps = 2, 1
    with pytest.raises(Fp8kitError, match="save_steps needs output_dir"):
        train(model, tok, ["the quick"], [_zero], config, rollout=_NoRollout())


def test_a_dataframe_of_prompts_is_refused_and_errors_stay_on_one_line(tiny_fp8):
    """Iterating a DataFrame gives its column names: it trained on the prompt 'prompt'."""
    pd = pytest.importorskip("pandas")
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    frame = pd.DataFrame({"prompt": ["the quick", "a lazy"], "answer": ["fox", "dog"]})
    with pytest.raises(Fp8kitError) as e:
        train(model, tok, frame, [_zero], config, rollout=_NoRollout())
    assert "to_dict('records')" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(Fp8kitError) as e:
        train(model, tok, {"train": ["the quick"], "test": ["a lazy"]}, [_zero], config, rollout=_NoRollout())
    assert "\n" not in str(e.value)


def test_gradient_checkpointing_and_the_mode_follow_the_config_and_are_restored(tiny_fp8):
    """gradient_checkpointing=False after a run with the default kept checkpointing on, and it stayed on after
    train() returned; the model left train() in training mode, so LoRA dropout acted on every later forward; the
    input-embedding hook of checkpointing stayed."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    assert not model.training
    seen = []
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    train(model, tok, ["the quick"], [_zero], config,
          on_step=lambda _: seen.append((model.is_gradient_checkpointing, model.training)))
    assert seen == [(True, True)] and not model.is_gradient_checkpointing and not model.training
    # nor the hook checkpointing puts on the input embeddings (their output requires grad): every later forward
    # built a graph through the frozen model, one hook more each run
    embeddings = model.get_input_embeddings()
    assert not embeddings._forward_hooks and not embeddings(torch.tensor([[1, 2]])).requires_grad
    model.gradient_checkpointing_enable()
    model.train()
    config.gradient_checkpointing = False
    train(model, tok, ["the quick"], [_zero], config,
          on_step=lambda _: seen.append((model.is_gradient_checkpointing, model.training)))
    assert seen[1] == (False, True) and model.is_gradient_checkpointing and model.training
    assert len(embeddings._forward_hooks) == 1  # the caller's own, from its gradient_checkpointing_enable
    config.gradient_checkpointing = True
    train(model, tok, ["the quick"], [_zero], config)
    assert len(embeddings._forward_hooks) == 1 and model._require_grads_hooks[0].id in embeddings._forward_hooks


def test_async_reward_functions_are_awaited_together(tiny_fp8):
    """An async def reward function (TRL's GRPOTrainer awaits them) failed after a whole rollout: "returned
    coroutine"; two of them run concurrently, beside a plain one, also from a thread with a running event loop."""
    import asyncio

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    both = []

    async def judge(completions, **_):
        both.append(1)
        while len(both) < 2:  # returns only once the other judge has started: they run together
            await asyncio.sleep(0.01)
        return [0.25] * len(completions)

    async def judge_again(completions, **_):
        return await judge(completions)

    [m] = train(model, tok, ["the quick"], [judge, _zero, judge_again], config)
    assert m["reward_mean"] == 0.5 and m["reward/judge"] == 0.25 and m["reward/judge_again"] == 0.25

    async def inside_a_loop():  # as in Jupyter
        return train(model, tok, ["the quick"], [judge], config)

    both.append(1)
    assert asyncio.run(inside_a_loop())[0]["reward_mean"] == 0.25


def test_bad_model_tokenizer_rollout_or_prompts_are_one_line(tiny_fp8):
    """Each was a Python traceback (TypeError, AttributeError), the rollout's only after a whole step."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    for kwargs, needle in ((dict(model=None), "model=None: expected the model load_model returned"),
                           (dict(tokenizer=None), "tokenizer=None: expected the tokenizer"),
                           (dict(rollout=object()), "it has no generate(); pass an engine with generate(), "
                                                    "sync_lora(), sleep(), wake()"),
                           (dict(prompts=None), "prompts=None: expected a list"),
                           (dict(prompts=[{"prompt": "the", 1: "x"}]), "a row has the key 1; column names must be")):
        args = {**dict(model=model, tokenizer=tok, prompts=["the quick"], reward_funcs=[_zero], config=config),
                **kwargs}
        with pytest.raises(Fp8kitError) as e:
            train(**args)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value
    for kwargs, needle in ((dict(name=None), "name=None: expected a Hub repo id"),
                           (dict(fast_inference="no"), "fast_inference='no': expected True"),
                           (dict(gpu_memory_utilization=5), "gpu_memory_utilization=5: expected a fraction"),
                           (dict(vllm_kwargs=[1]), "vllm_kwargs=[1]: expected a dict")):
        with pytest.raises(Fp8kitError, match=re.escape(needle)):
            load_model(**{"name": str(tiny_fp8), **kwargs})


def test_train_leaves_the_callers_random_stream_where_it_was(tiny_fp8):
    """Each rollout reseeded torch's global generator from the run's seed: after train() the caller's draws were a
    function of config.seed."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=2, prompts_per_step=1, num_generations=2, max_completion_length=2)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    train(model, tok, ["the quick"], [_zero], config)
    assert torch.equal(torch.rand(3), want)


def test_the_last_step_is_checkpointed_when_steps_is_not_a_multiple_of_save_steps(tiny_fp8, tmp_path):
    """steps=3, save_steps=2 left checkpoint-2 as the newest: step 3's update was never saved."""
    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=3, prompts_per_step=1, num_generations=2, max_completion_length=2,
                        output_dir=str(tmp_path / "run"), save_steps=2)
    train(model, tok, ["the quick"], [_zero], config)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())["step"] == 3


def test_resuming_with_other_settings_says_which(tiny_fp8, tmp_path):
    """A resume with another seed or group size trained on silently, no longer replaying the run; more steps (under a
    constant learning rate), another output_dir or save_steps change nothing that is replayed and say nothing."""
    import warnings

    model, tok = load_model(str(tiny_fp8), lora_rank=4, dtype=torch.float32, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2,
                        output_dir=str(tmp_path / "run"), save_steps=1)
    train(model, tok, ["the quick"], [_zero], config)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    longer = GRPOConfig(steps=2, prompts_per_step=1, num_generations=2, max_completion_length=2,
                        output_dir=str(tmp_path / "more"), save_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [m["step"] for m in train(model, tok, ["the quick"], [_zero], longer, resume_from=checkpoint)] == [2]
    done = GRPOConfig(steps=1, prompts_per_step=1, num_generations=2, max_completion_length=2)
    with pytest.warns(UserWarning, match=r"checkpoint-1 is at step 1 and steps=1: nothing left to train; pass a "
                                         r"larger steps"):
        assert train(model, tok, ["the quick"], [_zero], done, resume_from=checkpoint) == []
    # under a decaying learning rate more steps change every later rate: said too
    decaying = dict(prompts_per_step=1, num_generations=2, max_completion_length=2, lr_scheduler="linear")
    train(model, tok, ["the quick"], [_zero], GRPOConfig(steps=2, output_dir=str(tmp_path / "lin"), save_steps=1,
                                                         **decaying))
    with pytest.warns(UserWarning, match=r"checkpoint-1 with settings other than its run's \(steps 2 -> 4\)"):
        train(model, tok, ["the quick"], [_zero], GRPOConfig(steps=4, **decaying),
              resume_from=tmp_path / "lin" / "checkpoint-1")
    other = GRPOConfig(steps=2, prompts_per_step=1, num_generations=3, max_completion_length=2, seed=1)
    with pytest.warns(UserWarning, match=r"resuming from .*checkpoint-1 with settings other than its run's "
                                         r"\(num_generations 2 -> 3; seed 0 -> 1\)"):
        train(model, tok, ["the quick"], [_zero], other, resume_from=checkpoint)


def test_a_tokenizer_without_eos_pads_with_the_generation_configs_stop_token_or_is_refused(tiny_fp8, tmp_path):
    """It left pad_token None: a TypeError in the first rollout (torch.full(..., None))."""
    import shutil

    src = tmp_path / "no-eos"
    shutil.copytree(tiny_fp8, src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    config.pop("pad_token", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    model, tokenizer = load_model(str(src), lora_rank=4, device="cpu")
    assert tokenizer.pad_token_id == 2
    [m] = train(model, tokenizer, ["a b"], [_zero], GRPOConfig(steps=1, prompts_per_step=1, num_generations=2,
                                                               max_completion_length=3))
    assert m["step"] == 1
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    with pytest.raises(Fp8kitError, match="neither a pad nor an EOS token"):
        load_model(str(src), lora_rank=4, device="cpu")


def test_vllm_kwargs_load_model_sets_or_that_break_the_sharing_are_refused():
    from fp8kit.rl.vllm_engine import check_engine_kwargs

    check_engine_kwargs({"kv_cache_memory_bytes": 1 << 30, "tensor_parallel_size": 1})
    for kwargs, needle in [({"dtype": "float16"}, "pass load_model's dtype instead"),
                           ({"max_model_len": 4096}, "pass load_model's max_seq_length instead"),
                           ({"seed": 3}, "fp8kit sets it"),
                           ({"tensor_parallel_size": 2}, "use one GPU")]:
        with pytest.raises(Fp8kitError, match=needle):
            check_engine_kwargs(kwargs)


def test_the_rl_package_exports_what_a_run_needs():
    import fp8kit.rl as rl

    assert rl.load_model is load_model and rl.train is train and rl.GRPOConfig is GRPOConfig


def test_what_vllm_would_refuse_of_the_model_is_refused_before_converting_or_starting_it(tiny_fp8, tmp_path,
                                                                                           monkeypatch):
    """float16 for Gemma 3 (vLLM keeps it from gemma2/gemma3/glm4...) and a max_seq_length past the model's positions
    fail in one line before the conversion of an original and before vLLM starts: the vLLM path is taken on this
    CPU machine by reporting a GPU and vLLM, and the engine is never reached."""
    from fp8kit.rl import loader
    from fp8kit.rl import model as rl_model

    def as_if_a_gpu_with_vllm():
        monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
        for module in (rl_model, loader):
            monkeypatch.setattr(module, "check_device", lambda device: torch.device("cuda"))

    as_if_a_gpu_with_vllm()
    monkeypatch.setattr(rl_model, "_checkpoint", lambda *a: pytest.fail("converted before refusing"))
    gemma = build_checkpoint(tmp_path / "gemma", "gemma3", torch.bfloat16, seed=3)
    add_tokenizer(gemma, "the quick brown fox " * 20, vocab_size=300)
    with pytest.raises(Fp8kitError, match=r"gemma: vLLM does not run gemma3_text in float16.*dtype=torch.bfloat16"):
        load_model(str(gemma), dtype=torch.float16, lora_rank=16)
    with pytest.raises(Fp8kitError, match=r"gemma: max_seq_length=257 is past the model's 256 positions.*"
                                          r"max_seq_length=256 or less"):
        load_model(str(gemma), max_seq_length=257, lora_rank=16)
    monkeypatch.undo()
    as_if_a_gpu_with_vllm()
    monkeypatch.setattr(rl_model, "_tokenizer", lambda path: pytest.fail("went on past the checks"))
    with pytest.raises(Fp8kitError, match=r"llama-fp8: max_seq_length=300 is past the model's 256 positions"):
        load_model(str(tiny_fp8), max_seq_length=300, lora_rank=16)
    monkeypatch.undo()
    load_model(str(tiny_fp8), max_seq_length=300, lora_rank=16, fast_inference=False, device="cpu")  # transformers'


def test_the_longest_max_seq_length_is_vllms_own(tmp_path, monkeypatch):
    """vLLM derives the longest max_model_len from config.json's length (its model_max_length where set) and the RoPE
    factor, but does not extend Llama 3's RoPE: a Llama 3 config passed the early check as 'scaled' and vLLM then
    refused the length after the conversion. A tokenizer's shorter model_max_length is not vLLM's limit for a
    generative model (it reads it for pooling models only), so it is not refused for it either."""
    from transformers import LlamaConfig

    from fp8kit.rl.vllm_engine import check_rollout_model, vllm_max_model_len

    def config(model_max_length=None, **rope):
        made = LlamaConfig(max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0, **rope} if rope else None)
        if model_max_length:
            made.model_max_length = model_max_length
        return made

    llama3 = config(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=128)
    assert vllm_max_model_len(llama3)[0] == 256
    with pytest.raises(Fp8kitError) as e:
        check_rollout_model(llama3, tmp_path, torch.bfloat16, 257)
    assert "\n" not in str(e.value) and "max_seq_length=257 is past the model's 256 positions" in str(e.value)
    assert str(e.value).endswith("pass max_seq_length=256 or less")
    linear = config(rope_type="linear", factor=2.0)
    assert vllm_max_model_len(linear)[0] == 512
    check_rollout_model(linear, tmp_path, torch.bfloat16, 512)
    with pytest.raises(Fp8kitError, match="past the model's 256 positions .* times its RoPE factor 2"):
        check_rollout_model(linear, tmp_path, torch.bfloat16, 513)
    yarn = config(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    assert vllm_max_model_len(yarn) == (512, "YaRN's original_max_position_embeddings 128 times its RoPE factor 4")
    # config.json's model_max_length is the base, before the RoPE factor (Command-R's)
    assert vllm_max_model_len(config(model_max_length=512.0, rope_type="linear", factor=2.0))[0] == 1024
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 200}))
    check_rollout_model(config(), tmp_path, torch.bfloat16, 256)
    with pytest.raises(Fp8kitError, match="max_seq_length=257 is past the model's 256 positions"):
        check_rollout_model(config(), tmp_path, torch.bfloat16, 257)
    # a config vLLM is given instead (Qwen3's card extends its length with a YaRN factor in hf_overrides): vLLM's check
    check_rollout_model(config(), tmp_path, torch.bfloat16, 1024,
                        {"hf_overrides": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}})
    windowed = config()
    windowed.sliding_window = 64  # vLLM caps the length at the window when asked to disable it
    check_rollout_model(windowed, tmp_path, torch.bfloat16, 256)
    with pytest.raises(Fp8kitError, match=r"max_seq_length=65 is past the sliding window 64 \(disable_sliding_window\)"):
        check_rollout_model(windowed, tmp_path, torch.bfloat16, 65, {"disable_sliding_window": True})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override, taken as vLLM takes it
    check_rollout_model(config(), tmp_path, torch.bfloat16, 4096)
