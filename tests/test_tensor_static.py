"""--scheme tensor-static: static per-tensor activation scales calibrated through llm-compressor's oneshot."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from fp8kit import convert
from fp8kit.cli import fp8_convert
from fp8kit.models import add_tokenizer, build_checkpoint
from fp8kit.quality import load_causal_lm, logit_drift, quiet

pytest.importorskip("llmcompressor")
SAMPLE = "The quick brown fox jumps over the lazy dog. " * 40


def test_static_scales_calibrated_and_loadable(tmp_path):
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    calib = tmp_path / "calib.txt"
    calib.write_text(SAMPLE)
    report = convert(src, tmp_path / "static", scheme="tensor-static", calibration=calib)
    out = tmp_path / "static"
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor" and group["input_activations"]["strategy"] == "tensor"
    assert group["input_activations"]["dynamic"] is False and q["ignore"] == ["lm_head"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        input_scale = f.get_tensor("model.layers.0.self_attn.q_proj.input_scale")
    assert len([n for n in names if n.endswith(".input_scale")]) == len(report.quantized) == 14
    assert input_scale.numel() == 1 and float(input_scale) > 0
    assert (out / "tokenizer.json").exists() and not (out / "recipe.yaml").exists()
    # weights: the same per-tensor formula as our streaming `tensor` scheme
    convert(src, tmp_path / "dyn", scheme="tensor")
    # GRPO with vLLM refuses static scales (vLLM would use them, the trainer quantizes per token): told apart here
    from fp8kit.rl.loader import static_activation_scales

    assert static_activation_scales(out) and not static_activation_scales(tmp_path / "dyn")
    with safe_open(out / "model.safetensors", "pt") as a, safe_open(tmp_path / "dyn" / "model.safetensors", "pt") as b:
        name = "model.layers.1.mlp.down_proj.weight"
        codes_a, codes_b = (t.get_tensor(name).view(torch.uint8).to(torch.int16) for t in (a, b))
    if torch.cuda.is_available():
        # on a GPU llm-compressor calibrates and quantizes there: a few values at a rounding boundary landed one
        # FP8 code apart on an H100. A different scale or formula would move far more than 1% of the codes.
        steps = (codes_a - codes_b).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-2
    else:
        assert torch.equal(codes_a, codes_b)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with quiet(), torch.no_grad():
        drift = logit_drift(load_causal_lm(src)(input_ids=ids).logits, load_causal_lm(out)(input_ids=ids).logits)
    assert drift["kl"] < 5e-3


def test_needs_a_tokenizer_and_rejects_calibration_for_other_schemes(tmp_path, llama_dir):
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "tensor-static"])
    assert result.exit_code == 1 and "tokenizer" in result.stderr and not out.exists()
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "dynamic", "--calibration", "x.txt"])
    assert result.exit_code == 1 and "--calibration is for --scheme tensor-static" in result.stderr


def test_json_stdout_stays_clean(tmp_path):
    """llm-compressor logs on stdout; `--json` must still print exactly one JSON document there."""
    import subprocess
    import sys

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    proc = subprocess.run([sys.executable, "-m", "fp8kit.cli", "convert", str(src), str(tmp_path / "out"),
                           "--scheme", "tensor-static", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["scheme"] == "tensor-static"


def test_a_script_printing_the_output_path_prints_it_alone(tmp_path):
    """llm-compressor logs on stdout: the path a script prints (as `fp8kit resolve`'s ensure() command does) was
    buried under its log lines, which now go to stderr."""
    import subprocess
    import sys

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    out = tmp_path / "out"
    script = (f"from fp8kit import convert; print(convert({str(src)!r}, {str(out)!r}, scheme='tensor-static').out)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{out}\n"
    assert "Compression lifecycle" in proc.stderr  # llm-compressor's log, still shown


def test_stdout_to_stderr_in_a_process_without_stdout():
    """A service started with stdout closed: fp8kit.convert(tensor-static) now moves stdout to stderr in the
    library, which must not fail a conversion there (os.dup raised EBADF)."""
    import subprocess
    import sys

    script = ("import os; os.close(1); from fp8kit.converter.output import stdout_to_stderr\n"
              "with stdout_to_stderr():\n    pass\nos.write(2, b'ok')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b"ok", proc.stderr


def test_missing_tokenizer_is_one_line(tmp_path, llama_dir):
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "tensor-static"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {llama_dir}: --scheme tensor-static needs the model's tokenizer")
    assert f"copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into {llama_dir}" in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_device_cpu_refused_where_llmcompressor_calibrates_on_a_gpu(tmp_path, monkeypatch):
    """oneshot takes no device: its sequential pipeline moves every layer onto the first accelerator when one is
    visible, so --device cpu cannot be honoured there and is refused before anything runs."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "tensor-static", "--device", "cpu"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, (result.stderr, result.exception)
    assert lines[0].startswith("error: --device cpu: --scheme tensor-static calibrates through llm-compressor")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_device_and_shard_size_reach_the_calibration(tmp_path):
    """--device is where the model is calibrated (a GPU machine runs --device cuda there, this one --device cpu);
    --max-shard-size shards the output as it does for the other schemes."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "tensor-static", "--device", device,
                                              "--max-shard-size", "300KB", "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    report = json.loads(result.stdout)
    assert report["device"].split(":")[0] == device
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert all((out / s).stat().st_size < 300_000 + 200_000 for s in shards)  # a tensor may exceed the limit alone


def test_nothing_quantized_by_llmcompressor_is_refused_and_nothing_written(tmp_path, monkeypatch):
    """Where llm-compressor leaves the selected weights alone (not torch Linear modules in some architecture), the
    output would be a BF16 copy labelled FP8: refused by reading back what was written. Its calibration is replaced
    by one that quantizes nothing, which is what such an architecture gets."""
    import llmcompressor

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    monkeypatch.setattr(llmcompressor, "oneshot", lambda **kwargs: None)
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "tensor-static", "--device", "cpu"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # beside loading progress bars
    assert result.exit_code == 1 and len(errors) == 1, (result.stderr, result.exception)
    assert errors[0].startswith(f"error: {src.resolve()}: llm-compressor quantized none of the 14 Linear weights")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_multimodal_vision_tower_stays_in_source_precision(tmp_path):
    """Gemma 3's vision tower is `vision_tower.encoder...` on disk and `model.vision_tower.encoder...` once loaded,
    the name llm-compressor matches ignore entries against: given the checkpoint's names it quantized the tower. The
    config's ignore list and the report name what was written: every Linear weight left in source precision."""
    src = build_checkpoint(tmp_path / "src", "gemma3_mm", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))), vocab_size=400)  # below the image token ids
    out = tmp_path / "out"
    report = convert(src, out, scheme="tensor-static", device="cpu")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {k[: -len(".weight")]: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(".weight")}
        scaled = {k[: -len(".input_scale")] for k in f.keys() if k.endswith(".input_scale")}
    fp8 = sorted(m for m, d in dtypes.items() if d == "F8_E4M3")
    assert fp8 == sorted(report.quantized) == sorted(scaled)
    assert len(fp8) == 14 and all(m.startswith("language_model.model.layers.") for m in fp8)
    vision_linears = [m for m in dtypes if m.startswith("vision_tower.") and (".mlp." in m or "_proj" in m)]
    assert len(vision_linears) == 9
    assert all(dtypes[m] == "BF16" for m in dtypes if m.startswith(("vision_tower.", "multi_modal_projector.")))
    # ignore list == the Linear weights written in BF16, by their names in the checkpoint and, for transformers,
    # which matches it against the loaded model's, by those too
    assert report.ignored == ["lm_head"] + sorted(vision_linears)
    assert sorted(q["ignore"]) == sorted(report.ignored + ["model." + m for m in vision_linears])
    assert all(dtypes[m] == "BF16" for m in q["ignore"] if m in dtypes) and not set(q["ignore"]) & set(fp8)
    # what llm-compressor is handed: the loaded model's names
    from transformers import AutoModelForCausalLM

    from fp8kit.converter.calibrated import _leave_alone, linear_checkpoint_names

    with quiet():
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    leave = _leave_alone(linear_checkpoint_names(model), set(report.quantized))
    assert "model.vision_tower.encoder.layers.0.mlp.fc1" in leave and "lm_head" in leave
    assert not [n for n in leave if "language_model" in n]


def test_full_disk_in_save_pretrained_is_one_line(tmp_path, monkeypatch):
    """transformers' save_pretrained writes through safetensors, which reports a full disk as a SafetensorError (not
    an OSError): one line, exit 1, nothing at OUT."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # part of the file, then no room: what safetensors' writer leaves
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "tensor-static", "--device", "cpu"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, (result.stderr, result.exception)
    assert errors[0] == (f"error: {out}: cannot write (No space left on device); free disk space or choose "
                         f"another OUT")
    assert not [line for line in result.stderr.splitlines() if "Traceback" in line or "SafetensorError" in line]
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_activation_scales_that_overflow_are_refused(tmp_path):
    """llm-compressor measures NaN input scales where an fp16 model's activations overflow; vLLM would serve them."""
    from test_kv_cache import overflowing_fp16_model

    src, calibration = overflowing_fp16_model(tmp_path / "src")
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "tensor-static",
                                              "--calibration", str(calibration)])
    assert result.exit_code == 1 and not out.exists(), result.output
    last = result.stderr.strip().splitlines()[-1]  # the one line, after the libraries' progress bars
    assert "the calibrated model.layers.1." in last and "overflow float16" in last, last


def test_an_ignore_entry_of_llmcompressor_by_its_loaded_name_is_reported_once(tmp_path):
    """llm-compressor may write a module it left alone under the loaded model's name: the report names it once, by
    its checkpoint name, and the config names it both ways, as for the modules fp8kit keeps itself."""
    from fp8kit.converter.calibrated import _write_ignore

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"ignore": [
        "lm_head", "model.vision_tower.encoder.layers.0.mlp.fc1", "re:.*router$"]}}))
    names = {"model.vision_tower.encoder.layers.0.mlp.fc1": "vision_tower.encoder.layers.0.mlp.fc1",
             "model.language_model.layers.0.mlp.up_proj": "language_model.model.layers.0.mlp.up_proj",
             "lm_head": "lm_head"}
    reported = _write_ignore(tmp_path, names, ["vision_tower.encoder.layers.0.mlp.fc1"],
                             {"language_model.model.layers.0.mlp.up_proj"})
    assert reported == ["lm_head", "re:.*router$", "vision_tower.encoder.layers.0.mlp.fc1"]
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert sorted(written) == sorted(reported + ["model.vision_tower.encoder.layers.0.mlp.fc1"])


def test_moe_experts_named_in_ignore_stay_in_source_precision(tmp_path):
    """transformers 5 loads Qwen3-MoE's experts fused (no Linear to name) and llm-compressor splits them back into
    per-expert Linears: the experts --ignore keeps were never named to it, so it quantized them and the conversion
    failed after the whole calibration, advising --scheme tensor, which refuses this model."""
    src = build_checkpoint(tmp_path / "src", "qwen3_moe", torch.bfloat16, seed=3)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    out = tmp_path / "out"
    report = convert(src, out, scheme="tensor-static", device="cpu", ignore=[r"layers\.0\.mlp\.experts"])
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {k[: -len(".weight")]: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(".weight")}
    kept = sorted(m for m in dtypes if m.startswith("model.layers.0.mlp.experts."))
    later = [m for m in dtypes if m.startswith("model.layers.1.mlp.experts.")]
    assert kept and later and all(dtypes[m] == "BF16" for m in kept) and all(dtypes[m] == "F8_E4M3" for m in later)
    assert set(kept) <= set(report.ignored) and not set(kept) & set(report.quantized)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(kept) <= set(q["ignore"])


@pytest.mark.parametrize("generation", ['{"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9,\n'
                                        ' "my_field": "kept"}\n', None])
def test_the_source_generation_config_is_copied_as_it_is(tmp_path, generation):
    """transformers 5 refuses to save sampling fields without do_sample (the whole calibration ran first, then a
    traceback), and rewrote the file it saved (dropping fields of its own); a source without one gets none."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, SAMPLE + " ".join(map(str, range(500))))
    (src / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (src / "generation_config.json").write_text(generation)
    convert(src, tmp_path / "static", scheme="tensor-static")
    out = tmp_path / "static" / "generation_config.json"
    if generation is None:
        assert not out.exists()
    else:
        assert out.read_text() == generation
