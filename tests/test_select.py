"""Which tensors become FP8, from names and shapes alone (multimodal and MoE layouts of real uploads)."""

from pathlib import Path

import pytest

from fp8kit.converter.safetensors_io import TensorInfo
from fp8kit.converter.schemes import SCHEMES
from fp8kit.converter.select import select
from fp8kit.errors import Fp8kitError


def infos(shapes):
    return {n: TensorInfo(n, "BF16", s, Path("model.safetensors"), 0, 0) for n, s in shapes.items()}


def test_vision_tower_router_and_embeddings_are_kept():
    t = infos({
        "model.language_model.embed_tokens.weight": (1024, 256),
        "model.language_model.layers.0.self_attn.q_proj.weight": (256, 256),
        "model.language_model.layers.0.self_attn.k_proj.weight": (128, 256),
        "model.language_model.layers.0.self_attn.v_proj.weight": (128, 256),
        "model.language_model.layers.0.mlp.gate.weight": (8, 256),
        "model.language_model.layers.0.mlp.shared_expert_gate.weight": (1, 256),
        "model.language_model.layers.0.mlp.experts.0.up_proj.weight": (128, 256),
        "model.language_model.layers.0.input_layernorm.weight": (256,),
        "model.language_model.layers.0.self_attn.q_norm.weight": (64,),
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight": (128, 128),
        "model.visual.blocks.0.attn.qkv.weight": (384, 128),
        "model.multi_modal_projector.linear_1.weight": (256, 128),
        "lm_head.weight": (1024, 256),
    })
    sel = select(t, SCHEMES["block"], [])
    assert set(sel.quantize) == {"model.language_model.layers.0.self_attn.q_proj",
                                 "model.language_model.layers.0.self_attn.k_proj",
                                 "model.language_model.layers.0.self_attn.v_proj",
                                 "model.language_model.layers.0.mlp.experts.0.up_proj"}
    assert set(sel.keep) == {
        "lm_head", "model.language_model.layers.0.mlp.gate", "model.language_model.layers.0.mlp.shared_expert_gate",
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", "model.visual.blocks.0.attn.qkv",
        "model.multi_modal_projector.linear_1"}


def test_block_shape_rule_spreads_to_fused_siblings():
    t = infos({"model.layers.0.self_attn.q_proj.weight": (256, 256),
               "model.layers.0.self_attn.k_proj.weight": (64, 256),  # not a multiple of 128
               "model.layers.0.self_attn.v_proj.weight": (64, 256),
               "model.layers.0.self_attn.o_proj.weight": (256, 256)})
    sel = select(t, SCHEMES["block"], [])
    assert sel.quantize == ["model.layers.0.self_attn.o_proj"]
    assert "multiples of 128" in sel.warnings[0]
    assert select(t, SCHEMES["dynamic"], []).keep == []


def test_nothing_to_quantize_is_an_error():
    with pytest.raises(Fp8kitError, match="no weights to quantize"):
        select(infos({"model.embed_tokens.weight": (10, 4)}), SCHEMES["dynamic"], [])


def test_deepseek_mla_pair_and_mtp_head():
    t = infos({"model.layers.3.self_attn.q_a_proj.weight": (1536, 7168),
               "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),  # 576 % 128 != 0
               "model.layers.3.self_attn.kv_b_proj.weight": (32768, 512),
               "model.layers.61.eh_proj.weight": (7168, 14336),
               "model.layers.61.shared_head.head.weight": (129280, 7168)})
    sel = select(t, SCHEMES["block"], [])
    assert sel.quantize == ["model.layers.3.self_attn.kv_b_proj"]  # vLLM fuses q_a and kv_a: one status
    assert {"model.layers.61.eh_proj", "model.layers.61.shared_head.head"} <= set(sel.keep)


def test_fused_weights_of_more_than_two_dimensions():
    """Any >2-D weight inside a decoder layer is taken for fused experts, whatever its name, unless it is a
    convolution; parameters without a .weight suffix are, only when named for experts (gpt-oss, Llama 4)."""
    t = infos({"model.layers.0.block_sparse_moe.input_linear.weight": (4, 512, 256),  # GraniteMoe
               "model.layers.0.mlp.experts.gate_up_proj": (4, 256, 1024),  # gpt-oss
               "model.layers.0.mamba.conv1d.weight": (544, 1, 4),
               "model.layers.0.conv.conv.weight": (256, 1, 3),  # LFM2's short convolution
               "model.layers.0.att.time_mix_k": (1, 1, 256),  # not a weight, not experts
               "model.layers.0.self_attn.q_proj.weight": (256, 256)})
    with pytest.raises(Fp8kitError, match=r"'model.layers.0.block_sparse_moe.input_linear.weight' is a fused 3-D "
                                          r"expert tensor \[4, 512, 256\] \(and 1 more\)"):
        select(t, SCHEMES["dynamic"], [])
    sel = select(t, SCHEMES["dynamic"], [r"input_linear", r"experts\.gate_up_proj"])
    assert sel.quantize == ["model.layers.0.self_attn.q_proj"]
    assert sel.keep == ["model.layers.0.block_sparse_moe.input_linear", "model.layers.0.mlp.experts.gate_up_proj"]
    # in a vision tower, as any tensor there, kept without a word
    assert select(infos({"model.vision_tower.layers.0.mlp.w.weight": (4, 8, 8),
                         "model.layers.0.mlp.up_proj.weight": (8, 8)}), SCHEMES["dynamic"], []).keep == []


def test_qwen3_5_linear_attention_pairs_share_one_status():
    """vLLM 0.25 loads Qwen3.5's in_proj_qkv + in_proj_z as one in_proj_qkvz GEMM, and in_proj_b + in_proj_a as
    in_proj_ba: an --ignore of one member keeps its pair in source precision too."""
    attention = "model.language_model.layers.0.linear_attn"
    t = infos({f"{attention}.in_proj_qkv.weight": (512, 256), f"{attention}.in_proj_z.weight": (256, 256),
               f"{attention}.in_proj_b.weight": (128, 256), f"{attention}.in_proj_a.weight": (128, 256),
               f"{attention}.out_proj.weight": (256, 256)})
    sel = select(t, SCHEMES["dynamic"], ["in_proj_z", "in_proj_a"])
    assert sel.quantize == [f"{attention}.out_proj"]
    assert sorted(sel.keep) == sorted(f"{attention}.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                  "in_proj_a"))
    assert len(select(t, SCHEMES["dynamic"], []).quantize) == 5


def test_towers_named_otherwise_and_position_tables_are_kept():
    """Phi-4-multimodal's, Idefics2's, MiniCPM-V's and Granite Speech's encoders have `layers.N` too: they were
    quantized, and Granite Speech's 2-D `rel_pos_emb` (an Embedding) became raw FP8 codes in transformers."""
    towers = ["model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.self_attn.q_proj",
              "model.connector.perceiver_resampler.layers.0.self_attn.q_proj", "vpm.encoder.layers.0.mlp.fc1",
              "encoder.layers.0.attn.to_q", "encoder.layers.0.attn.rel_pos_emb"]
    language = ["language_model.model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                "model.encoder_decoder.layers.0.self_attn.q_proj"]
    sel = select(infos({f"{m}.weight": (256, 256) for m in towers + language}), SCHEMES["dynamic"], [])
    assert sorted(sel.quantize) == sorted(language)
    # the position table is no Linear: kept, and left out of the ignore list as embedding tables are
    assert set(towers[:-1]) <= set(sel.keep) and towers[-1] not in sel.keep
