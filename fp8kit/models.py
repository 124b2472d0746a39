"""Seeded random-weight checkpoints built from transformers configs, for the demo, tests and benchmarks.

No weights can be downloaded where fp8kit is tested, so every model it is checked on is made here:
real architectures (the same tensor names and shapes as the Hub uploads), random values.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

_COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)

# arch -> (config class, model class, tiny defaults)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=64, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, tie_word_embeddings=False)),  # biased q/k/v
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_COMMON, head_dim=64, sliding_window=64)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, head_dim=64, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, mlp_only_layers=[])),
    # Gemma 3 multimodal: a SigLIP vision tower whose encoder layers are named like the language model's
    "gemma3_mm": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                  dict(text_config=dict(_COMMON, head_dim=64, sliding_window=64),
                       vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=56, patch_size=14),
                       mm_tokens_per_image=4, image_token_index=500, boi_token_index=501, eoi_token_index=502)),
    # Mistral Small 3.x: a Pixtral vision tower; no causal-LM auto class takes its config
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                 dict(text_config=dict(_COMMON, model_type="mistral", tie_word_embeddings=False),
                      vision_config=dict(model_type="pixtral", hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14),
                      image_token_index=500, spatial_merge_size=2)),
    # Gemma 3n's text model: AltUp and per-layer-input projections, Linear modules outside the decoder blocks, two of
    # them (`altup_unembed_projections.N`) named after embeddings
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                dict(_COMMON, head_dim=64, vocab_size_per_layer_input=512, hidden_size_per_layer_input=128,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=64, num_kv_shared_layers=0,
                     altup_num_inputs=4, laurel_rank=64, activation_sparsity_pattern=[0.0, 0.0])),
    # Granite 4.0-h: Mamba and attention layers, experts fused into 3-D `block_sparse_moe.input_linear.weight`
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(_COMMON, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=256, layer_types=["mamba", "attention"], mamba_n_heads=8,
                              mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=1,
                              tie_word_embeddings=False)),
}


def build_checkpoint(path: str | Path, arch: str = "llama", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     max_shard_size: str = "5GB", device: str = "cpu", **overrides) -> Path:
    """Write a random-weight `arch` model (transformers' own init, seeded) as safetensors to `path`; the GPU
    benchmarks initialize 8B shapes with device="cuda", which takes seconds instead of minutes."""
    import transformers

    config_cls, model_cls, defaults = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**defaults, **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(dtype)
    path = Path(path)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bar
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def add_tokenizer(path: str | Path, text: str, vocab_size: int = 512) -> Path:
    """Train a small byte-level BPE on `text` and save it beside a random checkpoint: calibration and
    text validation need a tokenizer, and none can be downloaded. Its ids stay below `vocab_size`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return Path(path)
