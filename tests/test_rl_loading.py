"""What the RL loaders hand back: save_pretrained saves the adapter as peft does, checkpoints fp8kit cannot compute
(INT8, partial K blocks) and missing tokenizers are one line before anything loads, local paths are stored
absolute, LoRA A comes from a seed, and block FP8 carries LoRA on the Linears it keeps in source precision."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8kit import convert
from fp8kit.errors import Fp8kitError
from fp8kit.models import add_tokenizer, build_checkpoint
from fp8kit.quality import quiet, scheme_of
from fp8kit.rl import FP8LoRALinear, load_adapter, load_fp8_model, save_adapter
from fp8kit.rl.bf16_lora import LoRALinear
from fp8kit.rl.loader import DEFAULT_SEED, load_lora_model, lora_modules

IDS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def src32(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("src32") / "llama", "llama", torch.float32, seed=1)


@pytest.fixture(scope="module")
def fp8_dir(src32):
    return Path(convert(src32, src32.parent / "fp8", scheme="dynamic").out)


@pytest.fixture(scope="module")
def odd_block(odd_llama_dir, tmp_path_factory):
    """Block FP8 of a Llama whose MLP (320 wide) the converter keeps in source precision."""
    return Path(convert(odd_llama_dir, tmp_path_factory.mktemp("odd") / "block", scheme="block").out)


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def _random_b(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return model


def _leaves(model):
    return sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)})


# ---- save_pretrained ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_save_pretrained_saves_the_adapter_as_peft_does(fp8_dir, src32, tmp_path, kind):
    """transformers' save_pretrained wrote the FP8 weights under a config without their quantization_config,
    which reloaded as another model (logits off by 1.5)."""
    from peft import AutoPeftModelForCausalLM

    model = _random_b(load_fp8_model(fp8_dir, torch.float32, lora_rank=4, lora_alpha=8) if kind == "fp8"
                      else load_lora_model(src32, torch.float32, lora_rank=4, lora_alpha=8))
    model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    with safe_open(tmp_path / "saved" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert len(keys) == 2 * 14 and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)  # no base
    config = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((fp8_dir if kind == "fp8" else src32).resolve())
    with quiet():  # peft opens the base the adapter names (FP8 through compressed-tensors) and adds the adapter
        theirs = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    with torch.no_grad():
        assert (theirs(input_ids=IDS).logits - model(input_ids=IDS).logits).abs().max() <= 1e-4
    model.save_pretrained(str(tmp_path / "nowhere"), is_main_process=False, safe_serialization=True)
    assert not (tmp_path / "nowhere").exists()  # only the main process writes, as in transformers and peft


def test_transformers_trainer_saves_the_adapter(fp8_dir, tmp_path):
    """Trainer._save calls save_pretrained(folder, state_dict=...) (transformers 5.17): refusing unknown options
    made every Trainer checkpoint fail. peft's options (safe_serialization=False, selected_adapters) are taken too;
    the adapter is always written as safetensors."""
    from transformers import Trainer, TrainingArguments

    model = _random_b(load_fp8_model(fp8_dir, torch.float32, lora_rank=4, lora_alpha=8))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    with quiet():
        Trainer(model=model, args=args).save_model(str(tmp_path / "final"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "final").iterdir()}
    assert not any(p.name.startswith("model") for p in (tmp_path / "final").iterdir())  # no base weights
    model.save_pretrained(tmp_path / "peft", safe_serialization=False, selected_adapters=["default"], state_dict=None)
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize("call,needle", [
    (lambda m, d: m.save_pretrained(d, push_to_hub=True), "save_pretrained(push_to_hub=True): fp8kit does not upload"),
    (lambda m, d: m.save_pretrained(d, selected_adapters=["other"]), "carry one adapter, 'default'"),
    (lambda m, d: m.save_pretrained(d, False), "positional argument"),
    (lambda m, d: m.save_pretrained(None), "expected a folder path"),
    (lambda m, d: m.push_to_hub("me/adapter"), "push_to_hub: fp8kit does not upload"),
], ids=["push", "adapters", "positional", "no-folder", "push_to_hub"])
def test_save_pretrained_refuses_what_it_does_not_do(fp8_dir, tmp_path, call, needle):
    model = load_fp8_model(fp8_dir, torch.float32, lora_rank=2)
    with pytest.raises(Fp8kitError) as e:
        call(model, tmp_path / "saved")
    _one_line(e, needle)
    assert not (tmp_path / "saved").exists()


# ---- checkpoints fp8kit cannot compute ----------------------------------------------------------------------

def test_int8_compressed_tensors_checkpoint_is_refused_by_its_config(fp8_dir, tmp_path):
    """llm-compressor's W8A8-INT8 was read as FP8 (only the strategy was looked at): a raw ValueError later."""
    int8 = shutil.copytree(fp8_dir, tmp_path / "int8")
    config = json.loads((int8 / "config.json").read_text())
    qc = config["quantization_config"]
    qc["format"] = "int-quantized"
    for side in ("weights", "input_activations"):
        qc["config_groups"]["group_0"][side]["type"] = "int"
    (int8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(int8, torch.float32)
    message = _one_line(e, "INT8", "fp8kit reads FP8 checkpoints")
    assert message.startswith(f"{int8 / 'config.json'}: ")


def _ct(**weights):
    args = {"type": "float", "num_bits": 8, "strategy": "channel", "block_structure": None, **weights}
    return {"config_groups": {"group_0": {"weights": args, "input_activations": {"type": "float", "num_bits": 8}}},
            "quant_method": "compressed-tensors"}


def test_scheme_of_is_strict():
    assert scheme_of(_ct()) == "dynamic"
    assert scheme_of(_ct(strategy="tensor")) == "tensor"
    assert scheme_of(_ct(strategy="block", block_structure=[128, 128])) == "block"
    assert scheme_of({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}) == "block"
    assert scheme_of({"quant_method": "fp8", "activation_scheme": "dynamic"}) == "tensor"
    # spellings real configs use: MiniMax-M2's fmt, compressed-tensors' legacy block string and upper-case strategy
    assert scheme_of({"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]}) == "block"
    assert scheme_of(_ct(strategy="block", block_structure="128x128")) == "block"
    assert scheme_of(_ct(strategy="CHANNEL")) == "dynamic"
    two = _ct()
    two["config_groups"]["group_1"] = two["config_groups"]["group_0"]
    assert scheme_of(two) == "dynamic"  # several groups of one scheme
    mixed = _ct()
    mixed["config_groups"]["group_1"] = _ct(strategy="tensor")["config_groups"]["group_0"]
    int_activations = _ct()
    int_activations["config_groups"]["group_0"]["input_activations"]["type"] = "int"
    for qc, needle in ((_ct(type="int"), "INT8 (W8A8 or W8A16)"), (_ct(num_bits=4), "FP4"),
                       (_ct(type="int", num_bits=4, strategy="group"), "INT4"),
                       (_ct(strategy="group"), "strategy 'group'"),
                       (_ct(strategy="block", block_structure=[64, 64]), "blocks of [64, 64]"),
                       (mixed, "different FP8 schemes (group_0: dynamic, group_1: tensor)"),
                       (int_activations, "input activations of type 'int'"),
                       ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
                       ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
                       ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
                       ({"quant_method": "compressed-tensors"}, "without config_groups"), ([], "not an object")):
        with pytest.raises(Fp8kitError) as e:
            scheme_of(qc, "some/config.json")
        message = _one_line(e, needle, "fp8kit reads FP8 checkpoints")
        assert message.startswith("some/config.json: ")
    with pytest.raises(Fp8kitError, match="^quantization_config: "):
        scheme_of(_ct(type="int"))


def test_block_checkpoint_with_partial_blocks_along_k_is_refused_at_load(odd_llama_dir, tmp_path):
    """llm-compressor quantizes a 320-wide MLP into partial 128x128 blocks: it loaded, then the first forward
    failed in a reshape."""
    out = Path(convert(odd_llama_dir, tmp_path / "blk", scheme="block").out)
    tensors = load_file(out / "model.safetensors")
    for key in [k for k in tensors if ".mlp." in k and k.endswith(".weight")]:
        w = tensors[key].float()
        n, k = w.shape
        pn, pk = -(-n // 128) * 128, -(-k // 128) * 128
        padded = torch.zeros(pn, pk)
        padded[:n, :k] = w
        blocks = padded.reshape(pn // 128, 128, pk // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        tensors[key] = (blocks / scale[:, None, :, None]).reshape(pn, pk)[:n, :k].to(torch.float8_e4m3fn)
        tensors[key[: -len("weight")] + "weight_scale"] = scale.bfloat16()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(out, torch.float32)
    message = _one_line(e, "model.layers.0.mlp.down_proj", "in_features 320", "fp8-convert", "source precision")
    assert message.startswith(f"{out / 'model.safetensors'}: ")


# ---- load_model's tokenizer, stored paths ---------------------------------------------------------------------

def test_load_model_without_tokenizer_files_is_one_line_before_any_weight(fp8_dir, tmp_path, monkeypatch):
    from fp8kit.rl import model as rl_model

    bare = shutil.copytree(fp8_dir, tmp_path / "bare")
    monkeypatch.setattr(rl_model, "load_fp8_model", lambda *a, **k: pytest.fail("weights loaded first"))
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(bare, dtype=torch.float32, lora_rank=4, device="cpu")
    assert _one_line(e, "no tokenizer files", "tokenizer.json").startswith(f"{bare}: ")
    (bare / "tokenizer.json").write_text("{not json")
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(bare, dtype=torch.float32, lora_rank=4, device="cpu")
    assert _one_line(e, "transformers cannot load its tokenizer").startswith(f"{bare}: ")


def test_an_originals_broken_tokenizer_is_named_there_before_it_is_converted(src32, tmp_path, monkeypatch):
    """Only the tokenizer files' presence was checked before converting: a corrupt tokenizer.json failed after the
    conversion, naming the registry's cache folder ("copy the tokenizer files into this folder")."""
    from fp8kit.models import add_tokenizer
    from fp8kit.rl import model as rl_model

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "cache"))
    original = shutil.copytree(src32, tmp_path / "original")
    add_tokenizer(original, "the quick brown fox jumps over the lazy dog " * 20, vocab_size=300)
    (original / "tokenizer.json").write_text("{not json")
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(original, dtype=torch.float32, lora_rank=4, device="cpu")
    assert _one_line(e, "transformers cannot load its tokenizer").startswith(f"{original}: ")
    assert not (tmp_path / "cache").exists()  # refused before anything was converted


@pytest.mark.parametrize("loader", ["fp8", "bf16"])
def test_relative_local_paths_are_stored_absolute(fp8_dir, src32, tmp_path, monkeypatch, loader):
    """load_fp8_model('fp8') wrote base_model_name_or_path 'fp8', which peft cannot open from another folder."""
    folder = shutil.copytree(fp8_dir if loader == "fp8" else src32, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    load = load_fp8_model if loader == "fp8" else load_lora_model
    model = load(os.path.join("models", "tiny"), torch.float32, lora_rank=2)
    assert model.name_or_path == str(folder.resolve())
    save_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(folder.resolve())


# ---- seeded LoRA initialisation ------------------------------------------------------------------------------

def _a(model):
    return {n: m.lora_A.detach().clone() for n, m in lora_modules(model).items()}


def _same(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)


def test_lora_a_comes_from_the_seed_and_leaves_the_global_generator_alone(fp8_dir, src32):
    """LoRA A was drawn from the unseeded global generator: the same GRPOConfig(seed) gave different runs."""
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    first = _a(load_fp8_model(fp8_dir, torch.float32, lora_rank=4))
    assert torch.equal(torch.rand(4), expected_next)  # the caller's random state is untouched
    again = _a(load_fp8_model(fp8_dir, torch.float32, lora_rank=4, seed=DEFAULT_SEED))
    other = _a(load_fp8_model(fp8_dir, torch.float32, lora_rank=4, seed=1))
    assert DEFAULT_SEED == 3407 and _same(first, again)
    assert first.keys() == other.keys() and not any(torch.equal(first[n], other[n]) for n in first)
    # the BF16 baseline starts from the same adapter, also where fewer modules carry LoRA, and in bf16 the same
    # values rounded
    assert _same(_a(load_lora_model(src32, torch.float32, lora_rank=4)), first)
    q_only = _a(load_fp8_model(fp8_dir, torch.float32, lora_rank=4, target_modules=["q_proj"]))
    assert q_only and all(torch.equal(q_only[n], first[n]) for n in q_only)
    bf16 = _a(load_fp8_model(fp8_dir, torch.bfloat16, lora_rank=4))
    assert all(torch.equal(bf16[n], first[n].bfloat16()) for n in first)
    q = first["model.layers.0.self_attn.q_proj"]  # [rank, in_features]
    bound = 1 / q.shape[1] ** 0.5  # PEFT's Kaiming-uniform(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in))
    assert q.abs().max() <= bound and q.abs().max() > 0.9 * bound and q.std() > 0.5 * bound


def test_load_model_passes_the_seed(fp8_dir, tmp_path):
    from fp8kit.rl.model import load_model

    local = shutil.copytree(fp8_dir, tmp_path / "tiny")
    add_tokenizer(local, "the quick brown fox jumps over the lazy dog " * 20, vocab_size=300)
    runs = [_a(load_model(local, dtype=torch.float32, lora_rank=4, device="cpu", seed=s)[0]) for s in (5, 5, 6)]
    assert _same(runs[0], runs[1]) and not _same(runs[0], runs[2])
    assert _same(runs[0], _a(load_fp8_model(local, torch.float32, lora_rank=4, seed=5)))


@pytest.mark.parametrize("seed", [-1, 1.0, "1", True, None])
def test_bad_seed_is_one_line(fp8_dir, seed):
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(fp8_dir, torch.float32, seed=seed)
    assert _one_line(e).startswith(f"seed={seed!r}: expected an integer >= 0")


# ---- LoRA on Linears block FP8 keeps in source precision -----------------------------------------------------

def test_block_fp8_carries_lora_on_its_source_precision_linears(odd_block, odd_llama_dir, tmp_path):
    """The MLP of a 320-wide Llama stays in source precision under block FP8: it got no LoRA by default, and
    naming it was refused, while the BF16 baseline had LoRA on all seven projections."""
    from peft import PeftModel

    from fp8kit.quality import load_causal_lm

    model = _random_b(load_fp8_model(odd_block, torch.float32, lora_rank=4, lora_alpha=8))
    baseline = load_lora_model(odd_llama_dir, torch.float32, lora_rank=4, lora_alpha=8)
    assert _leaves(model) == _leaves(baseline) == PROJECTIONS
    assert lora_modules(model).keys() == lora_modules(baseline).keys()
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FP8LoRALinear)
    for name in ("gate_proj", "up_proj", "down_proj"):
        mlp = getattr(layer.mlp, name)
        assert isinstance(mlp, LoRALinear) and mlp.weight.dtype == torch.float32 and not mlp.weight.requires_grad
    assert _same(_a(model), _a(baseline))  # the same seed, the same initial adapter
    named = load_fp8_model(odd_block, torch.float32, lora_rank=4, target_modules=["gate_proj", "q_proj"])
    assert _leaves(named) == ["gate_proj", "q_proj"]
    # frozen base, trainable LoRA: a step moves the source-precision layers' LoRA too
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert layer.mlp.down_proj.lora_A.grad is not None and layer.mlp.down_proj.lora_A.grad.abs().sum() > 0
    model.zero_grad()

    # the adapter round-trips through peft on the original model and loads into the BF16 baseline (vLLM's names)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == PROJECTIONS
    with quiet():
        peft_model = PeftModel.from_pretrained(load_causal_lm(odd_llama_dir, torch.float32), tmp_path / "adapter")
    wrapped = 0
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            ours = model.get_submodule(name)
            assert torch.equal(module.lora_A["default"].weight, ours.lora_A)
            assert torch.equal(module.lora_B["default"].weight, ours.lora_B)
            wrapped += 1
    assert wrapped == len(lora_modules(model)) == 14
    load_adapter(baseline, tmp_path / "adapter")
    fresh = load_fp8_model(odd_block, torch.float32, lora_rank=4, lora_alpha=8, seed=9)
    load_adapter(fresh, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_lm_head_named_explicitly_gets_lora_in_fp8_as_in_the_baseline(fp8_dir, src32):
    """An untied lm_head stays in source precision: naming it was refused for FP8, accepted for BF16."""
    fp8 = load_fp8_model(fp8_dir, torch.float32, lora_rank=2, target_modules=["lm_head", "q_proj"])
    bf16 = load_lora_model(src32, torch.float32, lora_rank=2, target_modules=["lm_head", "q_proj"])
    assert isinstance(fp8.lm_head, LoRALinear) and fp8.lm_head.rank == 2
    assert lora_modules(fp8).keys() == lora_modules(bf16).keys()
    assert "lm_head" in _leaves(fp8) and isinstance(fp8.model.layers[0].mlp.up_proj, FP8LoRALinear)


def test_lora_on_a_tied_lm_head_is_refused_as_such(tmp_path):
    """Qwen3 ties lm_head to the embeddings: naming it said it "matches no Linear of the model", though it is one."""
    src = build_checkpoint(tmp_path / "src", "qwen3", torch.bfloat16, seed=1)
    out = Path(convert(src, tmp_path / "fp8", scheme="dynamic").out)
    for load, path in ((load_fp8_model, out), (load_lora_model, src)):
        with pytest.raises(Fp8kitError, match="ties lm_head to its input embeddings.*leave 'lm_head' out"):
            load(path, torch.float32, lora_rank=2, target_modules=["lm_head", "q_proj"])


@pytest.mark.parametrize("arch,model_class", [("gemma3_mm", "Gemma3ForConditionalGeneration"),
                                              ("mistral3", "Mistral3ForConditionalGeneration")])
def test_multimodal_models_train_their_language_model(tmp_path, arch, model_class):
    """Gemma 3 and Mistral 3 checkpoints name their language model `language_model.model.layers.N`, which
    transformers 5 builds as `model.language_model.layers.N` (and no causal-LM auto class takes Mistral 3's config):
    loading failed ("quantized module ... has no counterpart"). The checkpoint's names are renamed as from_pretrained
    renames them; LoRA goes on the language model alone (a vision tower's q_proj has a target's name), the adapter
    says so for peft, and the forward matches transformers' own load of the FP8 checkpoint within 1e-3 mean KL
    (transformers keeps these models' dequantized weights in bfloat16; a Llama matches it exactly)."""
    import warnings

    import transformers
    from peft import PeftModel

    from fp8kit.quality import logit_drift
    from fp8kit.rl.loader import checkpoint_mismatches

    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=3)
    out = Path(convert(src, tmp_path / "fp8", scheme="dynamic").out)
    model = load_fp8_model(out, torch.float32, lora_rank=4, seed=1)
    assert type(model).__name__ == model_class
    modules = lora_modules(model)
    assert len(modules) == 14 and all(".language_model.layers." in n for n in modules)
    assert all(isinstance(m, FP8LoRALinear) for m in modules.values())
    assert checkpoint_mismatches(model, out) == []
    baseline = load_lora_model(src, torch.float32, lora_rank=4, seed=1)
    assert sorted(lora_modules(baseline)) == sorted(modules)
    with quiet():
        reference = getattr(transformers, model_class).from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drift = logit_drift(reference(input_ids=ids).logits.float(), model(input_ids=ids).logits.float())
    assert drift["kl"] < 1e-3, drift
    for m in modules.values():
        torch.nn.init.normal_(m.lora_B, std=0.02)  # a trained adapter
    model(input_ids=ids).logits.float().square().mean().backward()
    assert all(m.lora_A.grad is not None and m.lora_A.grad.abs().sum() > 0 for m in modules.values())
    save_adapter(model, tmp_path / "adapter")
    with quiet(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(getattr(transformers, model_class).from_pretrained(src), tmp_path / "adapter")
    assert not [w for w in seen if "missing adapter keys" in str(w.message)]
    assert sorted(n[: -len(".lora_A")] for n, _ in peft_model.named_modules() if n.endswith(".lora_A")) == \
        sorted(f"base_model.model.{n}" for n in modules)
    reloaded = load_fp8_model(out, torch.float32, lora_rank=4, seed=2)
    load_adapter(reloaded, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_checkpoint_saved_without_the_model_prefix_loads_in_fp8(tmp_path):
    """A Llama saved without `model.` (from the base model): transformers adds the prefix to the names the model has,
    and the FP8 scales, which it has not, follow their weights (they stayed unplaced: "has no place in the model")."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.float32, seed=1)
    tensors = load_file(src / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, src / "model.safetensors", metadata={"format": "pt"})
    out = Path(convert(src, tmp_path / "fp8", scheme="dynamic").out)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "layers.0.mlp.down_proj.weight_scale" in f.keys()
    fp8 = load_fp8_model(out, torch.float32, lora_rank=2)
    assert isinstance(fp8.model.layers[0].mlp.down_proj, FP8LoRALinear)
    prefixed = build_checkpoint(tmp_path / "orig", "llama", torch.float32, seed=1)  # the same model, as saved
    reference = load_fp8_model(Path(convert(prefixed, tmp_path / "orig-fp8", scheme="dynamic").out), torch.float32,
                               lora_rank=2)
    with torch.no_grad():
        assert torch.equal(fp8(input_ids=IDS).logits, reference(input_ids=IDS).logits)


def test_a_quantized_vision_tower_gets_no_lora(tmp_path):
    """A checkpoint of another tool that quantizes a vision tower's q_proj: LoRA went on it (a target's name), and
    the adapter's exclude_modules then told peft to drop those weights."""
    from fp8kit.converter.schemes import SCHEMES, quantize_weight

    src = build_checkpoint(tmp_path / "src", "gemma3_mm", torch.bfloat16, seed=3)
    out = Path(convert(src, tmp_path / "fp8", scheme="dynamic").out)
    tensors = load_file(out / "model.safetensors")
    name = "vision_tower.encoder.layers.0.self_attn.q_proj"
    tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = quantize_weight(
        tensors[f"{name}.weight"].float(), SCHEMES["dynamic"], torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    qc["ignore"] = [n for n in qc["ignore"] if not n.endswith("vision_tower.encoder.layers.0.self_attn.q_proj")]
    (out / "config.json").write_text(json.dumps(config))
    model = load_fp8_model(out, torch.float32, lora_rank=4)
    vision_q = model.get_submodule("model." + name)
    assert isinstance(vision_q, FP8LoRALinear) and not vision_q.rank
    assert lora_modules(model) and not [n for n in lora_modules(model) if "vision_tower" in n]
