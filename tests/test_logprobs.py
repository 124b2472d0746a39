"""Chunked completion log-probabilities: the same values and gradients as the model's own forward, for every
architecture the shortcut is allowed on, and no full-vocabulary logits kept for backward."""

import pytest
import torch

from fp8kit import convert
from fp8kit.models import build_checkpoint
from fp8kit.rl import logprobs
from fp8kit.rl.loader import load_fp8_model, load_lora_model, lora_modules
from fp8kit.rl.logprobs import sampled_logprobs

VOCAB = 512


def _model(tmp_path, arch, fp8, lm_head=False, **overrides):
    src = build_checkpoint(tmp_path / arch, arch, torch.bfloat16, seed=7, **overrides)
    if fp8:
        out = tmp_path / f"{arch}-fp8"
        convert(src, out, scheme="dynamic", lm_head=lm_head)
        model = load_fp8_model(out, torch.float32, lora_rank=4, device="cpu")
    else:
        model = load_lora_model(src, torch.float32, lora_rank=4, device="cpu")
    with torch.no_grad():
        for i, m in enumerate(lora_modules(model).values()):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return model


def _inputs(rows=3, prompt=5, completion=7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (rows, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, positions, ids[:, prompt:]


def _full(model, ids, mask, positions, completion, temperature):
    """The model's own forward, as the GRPO trainer computed it before chunking."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
    return sampled_logprobs(logits, completion, temperature)


def _value_and_grads(fn, model):
    for p in model.parameters():
        p.grad = None
    out = fn()
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch,fp8,overrides", [
    ("llama", True, {}),
    ("qwen3", True, {}),  # tied embeddings: lm_head is embed_tokens
    ("mistral", False, {}),
    ("gemma3", True, {"final_logit_softcapping": 1.0}),  # small enough to bend these logits (|logit| < 2)
    ("qwen2", True, {}),
    ("llama", True, {"lm_head": True}),  # an FP8 head: chunks checkpointed and recomputed instead of fused
])
def test_chunked_equals_the_model_forward(tmp_path, arch, fp8, overrides):
    model = _model(tmp_path, arch, fp8, **overrides)
    assert model.config.model_type in logprobs.HEAD_ON_HIDDEN
    assert (type(model.lm_head) is torch.nn.Linear) != overrides.get("lm_head", False)
    ids, mask, positions, completion = _inputs()
    temperature = 0.7
    full, full_grads = _value_and_grads(lambda: _full(model, ids, mask, positions, completion, temperature), model)
    # chunks of 4 positions: 21 positions make 5 full chunks and a partial one
    ours, our_grads = _value_and_grads(lambda: logprobs.completion_logprobs(model, ids, mask, positions, completion,
                                                                            temperature, chunk=4), model)
    # float32, the same operations grouped differently: agreement to accumulation order
    torch.testing.assert_close(ours, full, rtol=0, atol=2e-5)
    assert full_grads.keys() == our_grads.keys() and full_grads
    for name in full_grads:
        torch.testing.assert_close(our_grads[name], full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_autograd_the_same_values(tmp_path):
    model = _model(tmp_path, "gemma3", True, final_logit_softcapping=1.0)
    ids, mask, positions, completion = _inputs()
    with_grad = logprobs.completion_logprobs(model, ids, mask, positions, completion, 0.8, chunk=4)
    with torch.no_grad():
        without = logprobs.completion_logprobs(model, ids, mask, positions, completion, 0.8, chunk=4)
    assert with_grad.requires_grad and not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


def test_other_model_types_run_the_model_forward(tmp_path, monkeypatch):
    model = _model(tmp_path, "llama", False)
    ids, mask, positions, completion = _inputs()
    expected = _full(model, ids, mask, positions, completion, 1.0)
    monkeypatch.setattr(logprobs, "HEAD_ON_HIDDEN", set())
    called = []
    monkeypatch.setattr(logprobs, "head_logprobs", lambda *a, **k: called.append(1))
    got = logprobs.completion_logprobs(model, ids, mask, positions, completion, 1.0)
    assert not called
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("frozen", [True, False])  # fused gradient, or checkpointed chunks
@pytest.mark.parametrize("softcap,top_p", [(None, 1.0), (5.0, 1.0), (None, 0.7), (5.0, 0.3)])
def test_head_logprobs_against_float64(frozen, softcap, top_p):
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 300, bias=True).double().requires_grad_(not frozen)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=g, dtype=torch.float64))
    hidden = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 300, (2, 9), generator=g)
    weights = torch.randn(2, 9, generator=g, dtype=torch.float64)  # an arbitrary upstream gradient
    logits = hidden @ head.weight.detach().T + head.bias.detach()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / 0.6
    if top_p < 1:  # top-p by hand in float64: the smallest probabilities summing to at most 1 - top_p drop out
        probs = torch.softmax(z.detach(), dim=-1)
        below = (probs[..., None, :] < probs[..., :, None]).to(probs.dtype)  # [.., v, w]: p_w < p_v
        mass_below = (below * probs[..., None, :]).sum(-1) + probs  # each token's p plus all smaller ones
        drop = (mass_below <= 1 - top_p) & (probs < probs.amax(-1, keepdim=True))
        drop.scatter_(-1, tokens[..., None], False)  # the sampled token always counts
        z = z.masked_fill(drop, float("-inf"))
        assert drop.any(-1).all()  # the nucleus is a strict subset at every position
    reference = torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None])[..., 0]
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), hidden)
    got = logprobs.head_logprobs(hidden, tokens, head, 0.6, softcap, chunk=5, top_p=top_p)
    assert got.dtype == torch.float32  # sampled_logprobs' precision: float32 logits
    (grad,) = torch.autograd.grad((got * weights).sum(), hidden)
    torch.testing.assert_close(got.double(), reference.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=1e-5)


def _saved_shapes(fn):
    """The shapes of the tensors autograd keeps for backward while fn runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


@pytest.mark.parametrize("fp8_head", [False, True])  # fused gradient, or checkpointed and recomputed chunks
def test_no_full_logits_kept_for_backward(tmp_path, monkeypatch, fp8_head):
    model = _model(tmp_path, "llama", True, lm_head=fp8_head)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, positions, completion = _inputs(rows=4, prompt=4, completion=40)

    def vocab_wide(shapes):
        return sum(torch.Size(s).numel() for s in shapes if s and s[-1] == VOCAB)

    full, shapes = _saved_shapes(lambda: _full(model, ids, mask, positions, completion, 1.0))
    assert vocab_wide(shapes) >= completion.numel() * VOCAB  # the plain path keeps [rows, T, vocab] for backward

    head_rows = []  # positions per head GEMM: through the module (FP8 head) or F.linear (fused)
    model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(out.reshape(-1, VOCAB).shape[0]))
    linear = logprobs.F.linear

    class Recording:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(*args):
            out = linear(*args)
            head_rows.append(out.shape[0])
            return out

    monkeypatch.setattr(logprobs, "F", Recording())
    ours, shapes = _saved_shapes(lambda: logprobs.completion_logprobs(model, ids, mask, positions, completion, 1.0,
                                                                      chunk=16))
    assert vocab_wide(shapes) <= 16 * VOCAB  # at most one chunk of logits kept
    assert head_rows and max(head_rows) <= 16 and sum(head_rows) >= completion.numel()  # computed chunk by chunk
    ours.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_rollout_logprobs_match_a_teacher_forced_forward(tmp_path):
    """transformers' generate reports each sampled token's log-probability under logits / T (kept one step at a
    time): a forward over prompt + completion gives the same, up to KV-cache accumulation order, also for rows
    that stop early at EOS and whatever the checkpoint's own generation_config says. The float32 LoRA model, not
    FP8: a per-token activation scale computed in another accumulation order can flip an FP8 rounding, which moves
    a log-probability by up to ~2e-2 (measured over eight LoRA seeds), hiding what this test checks."""
    from transformers import GenerationConfig

    from fp8kit.rl.rollout import HFRollout

    model = _model(tmp_path, "qwen3", False)
    model.generation_config = GenerationConfig(repetition_penalty=3.0, min_p=0.5, suppress_tokens=[7, 8, 9])

    class Tok:
        pad_token_id, eos_token_id = 0, 1

    prompts = [[5, 6, 7, 8], [9, 10]]
    first = HFRollout(model, Tok()).generate(prompts, n=3, max_tokens=9, temperature=0.7, seed=3)
    assert model.generation_config.repetition_penalty == 3.0  # the checkpoint's config is back
    Tok.eos_token_id = first[0].token_ids[2]  # the same seed again: row 0 now stops at its third token
    completions = HFRollout(model, Tok()).generate(prompts, n=3, max_tokens=9, temperature=0.7, seed=3)
    assert len(completions) == 6 and len(completions[0].token_ids) == 3
    assert max(len(c.token_ids) for c in completions) > 3
    for i, c in enumerate(completions):
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 9
        ids = torch.tensor([prompts[i // 3] + c.token_ids])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            forward = logprobs.completion_logprobs(model, ids, mask, mask.cumsum(-1) - 1,
                                                   torch.tensor([c.token_ids]), 0.7)[0]
        torch.testing.assert_close(torch.tensor(c.logprobs), forward, rtol=0, atol=1e-4)


def _peaked_head(dtype, vocab=8192, hidden=512, rows=192):
    """A head and hidden states whose sampled tokens are mostly near-certain (p > 0.999), as an LLM's are."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g) * 0.02
    target = torch.randint(0, vocab, (rows,), generator=g)
    direction = w[target] / w[target].norm(dim=1, keepdim=True)
    noise = torch.randn(rows, hidden, generator=g)
    h = torch.linspace(20, 90, rows)[:, None] * (0.8 * direction + 0.6 * noise / noise.norm(dim=1, keepdim=True))
    p = torch.softmax(h.double() @ w.double().T, -1)
    tokens = torch.multinomial(p.float(), 1, generator=g)[:, 0]
    p_token = p.gather(1, tokens[:, None])[:, 0]
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(w.to(dtype))
    up = torch.randn(rows, generator=g).sign() / 2048  # a GRPO-sized upstream gradient (advantage / tokens)
    hh = h.double().requires_grad_()
    reference = torch.log_softmax(hh @ head.weight.double().T, -1).gather(1, tokens[:, None])[:, 0]
    (reference * up.double()).sum().backward()
    return head, h, tokens, p_token, up, hh.grad


@pytest.mark.parametrize("dtype,scale,band,tol", [
    # float32: a confident token's 1 - p (1e-6 and below) was lost to 1 - exp(0): 105% off (median), as
    # autograd's log_softmax is; 3.5e-6 now
    (torch.float32, 1.0, (0.99999, 1.1), 1e-4),
    # float16 (with GradScaler's 2^16): d logp / d logits cast unscaled lost the probabilities under 6e-5: 1.6%
    # off (5% with a 38k vocabulary), 0.49% now
    (torch.float16, 2.0 ** 16, (0.999, 0.99999), 0.008),
])
def test_fused_head_gradient_of_confident_tokens_against_float64(dtype, scale, band, tol):
    head, h, tokens, p_token, up, want = _peaked_head(dtype)
    hidden = h.to(dtype).requires_grad_()
    got = logprobs.head_logprobs(hidden, tokens, head, chunk=64)
    (got * (up * scale)).sum().backward()
    rows = (p_token >= band[0]) & (p_token < band[1])
    err = (hidden.grad.double() / scale - want).norm(dim=1) / want.norm(dim=1)
    assert rows.sum() >= 10 and err[rows].median() < tol, (int(rows.sum()), float(err[rows].median()))


def test_top_p_on_full_logits_is_sorted_a_chunk_at_a_time(monkeypatch):
    """Models whose forward makes the full logits: the nucleus sort runs over chunks of rows, with the same result."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 50, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    whole = logprobs.sampled_logprobs(logits, tokens, 0.8, top_p=0.6)
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS", 100)  # two rows per sort
    chunked = logprobs.sampled_logprobs(logits, tokens, 0.8, top_p=0.6)
    assert torch.equal(whole, chunked) and (whole > logprobs.sampled_logprobs(logits, tokens, 0.8) + 1e-3).any()
