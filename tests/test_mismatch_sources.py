"""mismatch_sources' two forward passes differ only in the rounding they are meant to isolate, and FP8 magnifies it."""

import torch
import transformers

from evals.mismatch_sources import fused_and_trainer_logps, kl_stats
from fp8kit import convert
from fp8kit.rl.fp8_linear import FP8LoRALinear
from fp8kit.rl.loader import load_fp8_model


def test_fp8_amplifies_the_rounding_difference(llama_dir, tmp_path):
    fp8_dir = tmp_path / "fp8"
    convert(llama_dir, fp8_dir, scheme="dynamic")
    ids = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    fp8 = load_fp8_model(fp8_dir, torch.float32, lora_rank=4).eval()
    logps, _, first_inputs = fused_and_trainer_logps(fp8, FP8LoRALinear, ids, completion=16)
    assert logps["trainer"].shape == (2, 16, fp8.config.vocab_size)
    # the hooks saw layer 0's q_proj input unrounded in the fused pass only
    assert torch.equal(first_inputs["trainer"], first_inputs["fused"])
    assert not torch.equal(first_inputs["fused"], first_inputs["fused"].to(torch.bfloat16).float())
    assert not any(m._forward_pre_hooks for m in fp8.modules())  # removed afterwards
    fp8_kl = kl_stats(logps)["kl_fused_vs_trainer_mean"]

    source = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                               use_safetensors=True).eval()
    bf16_kl = kl_stats(fused_and_trainer_logps(source, torch.nn.Linear, ids, completion=16)[0])
    assert 0 < bf16_kl["kl_fused_vs_trainer_mean"] < fp8_kl / 10
    same = kl_stats({"fused": logps["trainer"], "trainer": logps["trainer"]})
    assert same["kl_fused_vs_trainer_mean"] == 0 and same["top1_agreement"] == 1
