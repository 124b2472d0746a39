"""Bad input: one clear line naming the file or tensor, a non-zero exit, and nothing left at OUT."""

import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from fp8kit.cli import fp8_convert
from fp8kit.errors import Fp8kitError
from fp8kit.models import add_tokenizer, build_checkpoint


def run_cli(*args):
    result = CliRunner().invoke(fp8_convert, [str(a) for a in args])
    return result.exit_code, result.stderr


def assert_clean_failure(code, err, out, *needles):
    assert code != 0
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and not leftovers(out)


def leftovers(out):
    """The converter's private temporary folders beside OUT."""
    return list(out.parent.glob(f".{out.name}.*"))


@pytest.fixture
def src(tmp_path, llama_dir):
    path = tmp_path / "src"
    shutil.copytree(llama_dir, path)
    return path


def test_missing_src(tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(tmp_path / "nope", out, "--scheme", "dynamic"), out, "nope", "no such directory")


def test_pickle_only_is_refused_without_unpickling(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    # A pickle that would create a file if it were ever unpickled.
    marker = tmp_path / "unpickled"
    payload = (b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    (src / "pytorch_model.bin").write_bytes(payload)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "pytorch_model.bin", "never unpickles")
    assert not marker.exists()


def test_truncated_shard(src, tmp_path):
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.safetensors", "truncated")


def test_corrupt_header(src, tmp_path):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "block"), out, "model.safetensors", "corrupt")


def test_index_names_missing_shard_and_missing_tensor(src, tmp_path):
    out = tmp_path / "out"
    shard = "model-00001-of-00002.safetensors"
    (src / "model.safetensors").rename(src / shard)  # model.safetensors would be read instead of the index
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model-00002-of-00002.safetensors", "missing")
    index["weight_map"] = {"model.norm.weight": shard, "model.layers.9.mlp.up_proj.weight": shard}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.layers.9.mlp.up_proj.weight")


def test_already_quantized(llama_dir, tmp_path):
    fp8 = tmp_path / "fp8"
    assert run_cli(llama_dir, fp8, "--scheme", "dynamic")[0] == 0
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(fp8, out, "--scheme", "dynamic"), out, "config.json", "already quantized")
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    assert_clean_failure(*run_cli(fp8, out, "--scheme", "dynamic"), out, "already quantized", "model.layers.0.mlp.down_proj.weight")


def test_nan_in_weight(src, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.layers.1.mlp.down_proj.weight", "NaN")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = 0.0
    tensors["model.norm.weight"][0] = float("inf")  # kept tensors are checked too
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(*run_cli(src, out, "--scheme", "tensor"), out, "model.norm.weight", "Inf")
    # --kv-cache runs the model first: its keys reached NaN, blamed on the activations ("convert a bfloat16 copy")
    tensors["model.norm.weight"][0] = 1.0
    tensors["model.layers.0.self_attn.k_proj.weight"][2, 3] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 20, vocab_size=300)
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic", "--kv-cache", "fp8"), out,
                         "model.layers.0.self_attn.k_proj.weight", "contains NaN or Inf; fix the source weights")


def test_unsupported_dtype(src, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"].double()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.layers.0.self_attn.o_proj.weight", "F64")
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"].bfloat16()
    tensors["lm_head.weight"] = tensors["lm_head.weight"].double()  # kept as is without --lm-head
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic", "--lm-head"), out, "'lm_head.weight'", "F64")


def test_fused_3d_experts_refused(tmp_path):
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=0)
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj.weight"] = torch.zeros(4, 256, 128, dtype=torch.bfloat16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "experts.gate_up_proj.weight", "3-D")
    code, err = run_cli(src, out, "--scheme", "dynamic", "--ignore", r"experts\.gate_up_proj")
    assert code == 0, err


def test_existing_out_needs_overwrite(llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(llama_dir, out, "--scheme", "dynamic")
    assert code != 0 and "--overwrite" in err and (out / "keep.txt").exists()
    code, err = run_cli(llama_dir, out, "--scheme", "dynamic", "--overwrite")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


@pytest.mark.parametrize("out", ["", ".", "..", "home"])
def test_overwrite_never_replaces_the_working_or_home_directory(llama_dir, tmp_path, monkeypatch, out):
    """An empty OUT resolved to the current directory, and --overwrite replaced it (the user's files with it)."""
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    (here / "mine.txt").write_text("mine")
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(tmp_path / "work"))
    code, err = run_cli(llama_dir, "~" if out == "home" else out, "--scheme", "dynamic", "--overwrite")
    expected = {"": "OUT is empty; name the directory", ".": "is the current directory, which --overwrite would "
                "delete", "..": "is your home directory", "home": "is your home directory"}[out]
    assert code != 0 and expected in err and err.count("\n") == 1, err
    assert (here / "mine.txt").read_text() == "mine" and sorted(p.name for p in here.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["here"]


def test_bad_options(llama_dir, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--format", "fp8"), out, "--format fp8")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--ignore", "("), out, "--ignore")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--max-shard-size", "lots"), out, "lots")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "block", "--format", "fp8", "--lm-head"), out, "--lm-head")
    # "for --scheme dynamic, block or tensor" named block, which --lm-head refuses
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "tensor-static", "--lm-head"), out,
                         "--lm-head is for --scheme dynamic or tensor:")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--lm-head", "--ignore", "head"), out,
                         "--lm-head", "--ignore")


def test_lm_head_is_refused_where_vllm_cannot_load_it(tmp_path):
    """Block: vLLM loads lm_head's scales with one row per token (VocabParallelEmbedding.weight_loader asserts it).
    A multimodal checkpoint: vLLM names some such heads language_model.lm_head (Mistral 3), which the config's
    'lm_head' target does not match. Both were written, and failed to load in vLLM."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1, vocab_size=500)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "block", "--lm-head"), out, "--lm-head takes --scheme dynamic "
                         "or tensor", "a block lm_head does not load")
    code, err = run_cli(src, out, "--scheme", "dynamic", "--lm-head")
    assert code == 0, err
    mm = build_checkpoint(tmp_path / "mm", "mistral3", torch.bfloat16, seed=1, tie_word_embeddings=False)
    assert_clean_failure(*run_cli(mm, tmp_path / "mm-out", "--scheme", "dynamic", "--lm-head"), tmp_path / "mm-out",
                         "--lm-head is for text models", "multi_modal_projector")


def test_block_in_the_fp8_format_of_mistral_3_is_refused(tmp_path):
    """vLLM's Mistral 3 loader renames weight_scale_inv to weight_scale, which its block FP8 layers lack: the
    checkpoint was written and failed to load. Compressed-tensors block is written as before."""
    src = build_checkpoint(tmp_path / "src", "mistral3", torch.bfloat16, seed=1)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "block", "--format", "fp8"), out, "mistral3",
                         "leave --format out")
    code, err = run_cli(src, out, "--scheme", "block")
    assert code == 0, err


@pytest.mark.parametrize("arch, tied", [("llama", False), ("gemma3", True)])
def test_lm_head_where_config_json_leaves_tying_to_the_architecture(tmp_path, arch, tied):
    """A config.json without tie_word_embeddings is untied for Llama (its config class's default) and tied for Gemma 3:
    --lm-head was refused for both ("true or unset")."""
    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=1, tie_word_embeddings=tied)
    config = json.loads((src / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    if tied:
        assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic", "--lm-head"), out, "--lm-head", "ties")
    else:
        code, err = run_cli(src, out, "--scheme", "dynamic", "--lm-head")
        assert code == 0, err
        assert "lm_head" not in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]


def test_lm_head_never_runs_the_checkpoints_own_config_code(tmp_path):
    """Reading the architecture's tying default went through AutoConfig without trust_remote_code=False: for a
    checkpoint with an auto_map, transformers asked on the terminal, and a "y" ran its configuration_*.py."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    config = json.loads((src / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    config.update(model_type="mycustomllama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (src / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "REMOTE_CODE_RAN"
    (src / "configuration_my.py").write_text(f"open({str(ran)!r}, 'w').write('yes')\n"
                                             "from transformers import LlamaConfig\n"
                                             "class MyConfig(LlamaConfig):\n    model_type = 'mycustomllama'\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "dynamic", "--lm-head"], input="y\n")
    assert result.exit_code == 1 and "--lm-head" in result.stderr, result.output
    assert not ran.exists() and "custom code" not in result.output


def cli_process(*args, preexec_fn=None):
    code = "from fp8kit.cli import fp8_convert; fp8_convert()"
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


def test_disk_full_while_writing(llama_dir, tmp_path):
    """A file-size limit makes the write fail part-way, as a full disk does (EFBIG instead of ENOSPC)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))

    out = tmp_path / "out"
    proc = cli_process(llama_dir, out, "--scheme", "dynamic", preexec_fn=limit)
    _, err = proc.communicate(timeout=120)
    assert_clean_failure(proc.returncode, err, out, "model.safetensors", "cannot write")


def test_a_checkpoint_of_more_shards_than_free_descriptors_converts(tmp_path):
    """Every source shard stayed open for the whole run: past the descriptor limit the conversion failed with a
    misleading "cannot write (Too many open files)" and left its temporary folder. One shard per tensor here
    (~80 shards), under a limit of 64 descriptors."""
    from safetensors.torch import load_file

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1, num_hidden_layers=8)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    weight_map = {}
    for i, (name, value) in enumerate(sorted(tensors.items())):
        shard = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({name: value}, src / shard, metadata={"format": "pt"})
        weight_map[name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(tensors) > 64 + 10

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    out = tmp_path / "out"
    proc = cli_process(src, out, "--scheme", "dynamic", preexec_fn=limit)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (out / "config.json").is_file() and not leftovers(out)


def test_a_source_shard_that_cannot_be_opened_is_named_as_such(tmp_path):
    """An os.open failure on a source shard reached the shard writer's handler as an OSError and was reported as
    "OUT: cannot write"."""
    from fp8kit.converter.streaming import _Inputs

    inputs = _Inputs()
    with pytest.raises(Fp8kitError) as e:
        inputs.fd(tmp_path / "model-00001-of-00002.safetensors")
    assert str(e.value).startswith(f"{tmp_path / 'model-00001-of-00002.safetensors'}: cannot open")
    inputs.close()


def test_model_safetensors_wins_over_a_stale_index_as_in_transformers(llama_dir, tmp_path):
    """save_pretrained re-saving a sharded model as one file deletes the shards but leaves the index: transformers
    loads model.safetensors first, and fp8-convert refused the folder ("names shard ..., which is missing")."""
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert code == 0, err
    assert (out / "model.safetensors").is_file()


def stop_mid_conversion(tmp_path, sig):
    """Start a conversion big enough to catch in flight, freeze it once its temporary folder exists,
    send `sig`, let it run on; returns (process, its stderr, OUT)."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.float32, seed=0, hidden_size=1024,
                           intermediate_size=4096, num_hidden_layers=6, vocab_size=1024)
    out = tmp_path / "out"
    proc = cli_process(src, out, "--scheme", "tensor")
    deadline = time.time() + 60
    while not leftovers(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    assert leftovers(out), "conversion finished before it could be stopped"
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    return proc, err, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupt_removes_partial_output(tmp_path, sig):
    proc, err, out = stop_mid_conversion(tmp_path, sig)
    assert proc.returncode == 130
    assert "interrupted" in err
    assert not out.exists() and not leftovers(out)


@pytest.mark.parametrize("layout", ["out_contains_src", "src_named_like_temp"])
def test_never_deletes_the_source(tmp_path, llama_dir, layout):
    if layout == "out_contains_src":
        src, out = tmp_path / "models" / "llama", tmp_path / "models"
    else:  # earlier versions removed OUT.partial before starting
        src, out = tmp_path / "x.partial", tmp_path / "x"
    shutil.copytree(llama_dir, src)
    before = sorted(p.name for p in src.iterdir())
    code, err = run_cli(src, out, "--scheme", "dynamic", "--overwrite")
    if layout == "out_contains_src":
        assert code != 0 and "must not" in err
    else:
        assert code == 0, err
    assert sorted(p.name for p in src.iterdir()) == before


def raw_checkpoint(tmp_path, header: dict, data: bytes, model_type: str = "llama"):
    """A checkpoint whose model.safetensors is written byte by byte (headers safetensors would refuse)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": model_type}))
    raw = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return src


@pytest.mark.parametrize("entry,data", [
    ({"dtype": "BF16", "shape": [-8], "data_offsets": [16, 0]}, b"\0" * 16),
    ({"dtype": "BF16", "shape": ["4"], "data_offsets": [0, 8]}, b"\0" * 8),
    ({"dtype": "BF16", "shape": [2.5, 2], "data_offsets": [0, 10]}, b"\0" * 10),
    ({"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}, b"\0" * 12),  # a gap at the end
    ({"dtype": ["BF16"], "shape": [4], "data_offsets": [0, 8]}, b"\0" * 8),
    ("not a dict", b""),
])
def test_malformed_headers_are_refused(tmp_path, entry, data):
    header = {"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
              "model.norm.weight": entry}
    if isinstance(entry, dict) and entry["data_offsets"][0] == 0:
        entry["data_offsets"] = [8 + entry["data_offsets"][0], 8 + entry["data_offsets"][1]]
    src = raw_checkpoint(tmp_path, header, b"\0" * 8 + data)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.safetensors")


def test_overlapping_tensors_are_refused(tmp_path):
    header = {"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
              "model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [4, 12]}}
    src = raw_checkpoint(tmp_path, header, b"\0" * 12)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "overlaps")


def test_transposed_conv1d_models_are_refused(tmp_path):
    header = {"h.0.attn.c_attn.weight": {"dtype": "F32", "shape": [128, 384], "data_offsets": [0, 128 * 384 * 4]}}
    src = raw_checkpoint(tmp_path, header, b"\0" * (128 * 384 * 4), model_type="gpt2")
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "gpt2", "transposed")


def test_fused_experts_without_weight_suffix_refused(tmp_path, llama_dir):
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.feed_forward.experts.gate_up_proj"] = torch.zeros(2, 256, 512, dtype=torch.bfloat16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "experts.gate_up_proj", "3-D")


def test_more_bad_options_and_outputs(llama_dir, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--max-shard-size", "99999999999999999999TB"), out,
                         "out of range")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--max-shard-size", "0MB"), out,
                         "--max-shard-size '0MB': out of range")  # as typed (it printed 0.0)
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--max-shard-size", "0.5"), out,
                         "--max-shard-size '0.5': out of range")  # half a byte: it wrote a shard per tensor
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "tensor-static", "--format", "fp8"), out,
                         "compressed-tensors format only")
    if not torch.cuda.is_available():
        assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic", "--device", "cuda"), out, "no CUDA")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    code, err = run_cli(llama_dir, a_file, "--scheme", "dynamic", "--overwrite")
    assert code != 0 and "not a directory" in err and a_file.read_text() == "mine"
    code, err = run_cli(llama_dir, "/", "--scheme", "dynamic")
    assert code != 0 and "OUT must name a new directory" in err


def test_malformed_config_and_index(src, tmp_path):
    out = tmp_path / "out"
    # an index is followed where there is no model.safetensors (which transformers, and fp8-convert, read first)
    (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": "fp8"}))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "already quantized")
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "weight_map must map")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "outside the checkpoint directory")
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.safetensors.index.json: weight_map is empty")


def test_empty_weights_are_kept_not_divided_by_zero(tmp_path):
    header = {"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [128, 128], "data_offsets": [0, 32768]},
              "model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [128, 0], "data_offsets": [32768, 32768]}}
    # a model_type transformers does not know: no architecture to check the two lone weights against
    src = raw_checkpoint(tmp_path, header, b"\0" * 32768, model_type="fp8kit-test")
    for scheme in ("dynamic", "tensor"):
        code, err = run_cli(src, tmp_path / scheme, "--scheme", scheme)
        assert code == 0, err
        q = json.loads((tmp_path / scheme / "config.json").read_text())["quantization_config"]
        assert "model.layers.0.mlp.down_proj" in q["ignore"]


def test_tensor_static_checks_the_options_every_scheme_takes(llama_dir, tmp_path):
    """tensor-static goes through llm-compressor, but its options are checked first, as the other schemes' are."""
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "tensor-static", "--ignore", "("), out,
                         "--ignore '('", "not a regular expression")
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "tensor-static", "--max-shard-size", "lots"), out,
                         "--max-shard-size 'lots'")
    if not torch.cuda.is_available():
        assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "tensor-static", "--device", "cuda"), out,
                             "--device cuda", "no CUDA")


@pytest.mark.parametrize("scheme", ["dynamic", "tensor-static"])
def test_out_under_a_file(llama_dir, tmp_path, scheme):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for out in (a_file / "out", a_file / "deeper" / "out"):
        assert_clean_failure(*run_cli(llama_dir, out, "--scheme", scheme), out, str(out),
                             f"{a_file} is not a directory")
    assert a_file.read_text() == "mine"


def test_output_directory_that_cannot_be_made(tmp_path):
    """Without check_out first (as fp8kit.rl saves its checkpoints): one line naming OUT instead of an OSError."""
    from fp8kit.converter.output import atomic_directory
    from fp8kit.errors import Fp8kitError

    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    out = a_file / "out"
    with pytest.raises(Fp8kitError, match=re.escape(f"{out}: cannot create the output directory ({a_file} is not a "
                                                    "directory)")):
        with atomic_directory(out, overwrite=False):
            pytest.fail("nothing to fill")
    assert a_file.read_text() == "mine"


def test_unwritable_out_parent(llama_dir, tmp_path, monkeypatch):
    """OUT's folder cannot be written into: one line naming OUT, and the folders made for OUT removed again."""
    out = tmp_path / "made" / "for" / "out"
    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):  # root may write anywhere: the refusal is simulated
        if self.parent == out.parent and ".partial-" in self.name:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic"), out, f"{out}: cannot create the output "
                         "directory (Permission denied)", f"make {tmp_path} writable")
    assert not (tmp_path / "made").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_parent(llama_dir, tmp_path):
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        out = parent / "out"
        assert_clean_failure(*run_cli(llama_dir, out, "--scheme", "dynamic"), out, str(out), "Permission denied")
    finally:
        parent.chmod(0o700)


def test_failed_conversion_removes_the_folders_it_made(src, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "made" / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "NaN")
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "made").exists()


def test_tensor_static_refuses_what_the_streaming_schemes_refuse(src, tmp_path):
    """It loads the model whole through transformers, where one NaN became NaN scales and weights, exit 0."""
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "tensor-static"), out, "model.layers.1.self_attn.o_proj.weight",
                         "NaN")
    # GPT-2's Conv1D layers, which llm-compressor's Linear targets skip: it printed "8 weights in FP8" for none
    (tmp_path / "g").mkdir()
    gpt2 = raw_checkpoint(tmp_path / "g", {"h.0.attn.c_attn.weight": {"dtype": "BF16", "shape": [2, 2],
                                                                       "data_offsets": [0, 8]}}, b"\0" * 8, "gpt2")
    assert_clean_failure(*run_cli(gpt2, out, "--scheme", "tensor-static"), out, "Conv1D")


def test_three_dimensional_tensors_that_are_not_experts_are_kept(src, tmp_path):
    """Mamba's depthwise conv1d [channels, 1, kernel] (Granite 4.0-h, Jamba, Bamba) is copied as it is."""
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    conv = torch.randn(544, 1, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors["model.layers.0.mamba.conv1d.weight"] = conv
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert code == 0, err
    assert torch.equal(load_file(out / "model.safetensors")["model.layers.0.mamba.conv1d.weight"], conv)


def test_deeply_nested_header_is_one_line(tmp_path):
    raw = b"[" * 100_000 + b"]" * 100_000
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.safetensors", "corrupt")


def test_nothing_left_to_quantize_names_the_checkpoint(src, tmp_path):
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic", "--ignore", "re:.*")
    assert_clean_failure(code, err, out, f"{src.resolve()}: no weights to quantize")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_gets_the_umask_s_modes_not_private_ones(tmp_path, umask):
    """OUT was renamed from a mkdtemp folder (0700), and safetensors' save_file wrote the KV-cache shard 0600: a vLLM
    server or a shared cache user on another account could not read them."""
    from fp8kit import convert
    from fp8kit.models import add_tokenizer

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1, max_shard_size="1MB")
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 40)
    old = os.umask(umask)
    try:
        out = Path(convert(src, tmp_path / "out", scheme="dynamic", kv_cache="fp8", max_shard_size="1MB").out)
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {p.name: os.stat(p).st_mode & 0o777 for p in files} == {p.name: 0o666 & ~umask for p in files}


def _unknown_architecture(tmp_path):
    from fp8kit.models import add_tokenizer

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 40)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "brandnewlm",
                                                  "architectures": ["BrandNewLMForCausalLM"]}))
    return src


@pytest.mark.parametrize("args,needle", [(["--scheme", "dynamic", "--kv-cache", "fp8"], "convert without --kv-cache"),
                                         (["--scheme", "tensor-static"], "use --scheme tensor or dynamic")])
def test_calibration_on_a_model_transformers_cannot_run_is_one_line(tmp_path, args, needle):
    """A 44-line traceback; the streaming schemes convert the same checkpoint, since they never run it."""
    src = _unknown_architecture(tmp_path)
    out = tmp_path / "out"
    code, err = run_cli(src, out, *args, "--device", "cpu" if "--kv-cache" in args else "auto")
    assert_clean_failure(code, err, out, str(src), "runs the model in transformers, which failed (ValueError", needle)
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert code == 0, err


@pytest.mark.parametrize("args", [["--scheme", "dynamic", "--kv-cache", "fp8", "--device", "cpu"],
                                  ["--scheme", "tensor-static"]])
def test_calibration_never_falls_back_to_a_pickle_beside_a_lone_shard(tmp_path, args):
    """A lone model-00001-of-00001.safetensors (no index: fp8kit reads it, transformers does not) beside a
    pytorch_model.bin: calibration loaded the pickle, unpickling it and measuring other weights than the ones
    converted. Here the .bin is not even a pickle: reading it would fail otherwise."""
    from fp8kit.models import add_tokenizer

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    add_tokenizer(src, "the quick brown fox jumps over the lazy dog " * 40)
    (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    (src / "pytorch_model.bin").write_bytes(b"not a pickle")
    out = tmp_path / "out"
    code, err = run_cli(src, out, *args)
    assert_clean_failure(code, err, out, str(src), "transformers loads safetensors weights only as model.safetensors",
                         "pickle files are never read")
    code, err = run_cli(src, out, "--scheme", "dynamic")  # the streaming schemes never run the model
    assert code == 0, err


def test_stray_adapter_beside_an_unindexed_checkpoint_is_neither_merged_nor_copied(src, tmp_path):
    """adapter_model.safetensors was quantized into OUT as if it were the model's; adapter_config.json was copied, so
    transformers went looking for the adapter's weights and OUT did not load."""
    from fp8kit import convert
    from fp8kit.converter.safetensors_io import read_header

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 256, dtype=torch.bfloat16)},
              str(src / "adapter_model.safetensors"))
    (src / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    out = Path(convert(src, tmp_path / "out", scheme="dynamic").out)
    names = set(read_header(out / "model.safetensors")[0])
    assert not any("lora" in n for n in names) and names
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()


def test_named_chat_templates_are_copied(src, tmp_path):
    """transformers saves a tokenizer's named templates in additional_chat_templates/: they were dropped."""
    from fp8kit import convert

    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    report = convert(src, tmp_path / "out", scheme="dynamic")
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    assert "additional_chat_templates/tool_use.jinja" in report.files


def test_unreadable_file_in_src_is_named_as_such(src, tmp_path, monkeypatch):
    """It was reported as 'OUT: cannot write (Permission denied); free disk space'. (Root reads anything, so the
    denial is simulated.)"""
    import builtins

    from fp8kit.converter import source

    def guarded(path, *args, **kwargs):
        if str(path) == str(src / "generation_config.json") and "w" not in (args[0] if args else "r"):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(source, "open", guarded, raising=False)
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert_clean_failure(code, err, out, f"{src / 'generation_config.json'}: cannot read (Permission denied)")


def test_block_with_no_weight_of_a_block_shape_says_so(tmp_path):
    """SmolLM2-like widths (576, 1536): 'no 2-D Linear weights inside decoder layers were found', yet dynamic quantizes
    every one of them."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1, hidden_size=192, intermediate_size=320,
                           num_attention_heads=3, num_key_value_heads=1, head_dim=64)
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "block")
    assert_clean_failure(code, err, out, "block FP8 needs both dimensions of a weight to be multiples of 128",
                         "use --scheme dynamic or tensor")


def test_model_type_that_is_not_a_string_is_one_line(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": ["llama"]}))
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert_clean_failure(code, err, out, f"{src / 'config.json'}: model_type must be a string")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_one_line(tmp_path, name):
    """json.loads raises RecursionError on [[[...]]] a hundred thousand deep, which was a traceback."""
    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=0, max_shard_size="300KB")
    nested = "[" * 100_000 + "]" * 100_000
    (src / name).write_text(nested if name == "config.json" else '{"weight_map": ' + nested + "}")
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, f"{src / name}: ", "nested too deeply")


@pytest.mark.parametrize("metadata", [["format", "pt"], {"format": 1}, {"format": None}, "pt"])
def test_metadata_that_is_not_a_map_of_strings_is_refused(tmp_path, metadata):
    """safetensors refuses a `__metadata__` that is not a map of strings to strings; so does fp8-convert."""
    header = {"__metadata__": metadata,
              "model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}
    src = raw_checkpoint(tmp_path, header, b"\0" * 8)
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", "dynamic"), out, "model.safetensors", "__metadata__")


def test_fused_experts_named_otherwise_are_refused_or_kept_and_listed(tmp_path):
    """Granite 4.0-h fuses its experts into `block_sparse_moe.input_linear.weight` [experts, 2 * inter, hidden]:
    no "expert" in the name, and it was copied in BF16 and left out of the ignore list. Refused like other fused
    experts; kept with the --ignore the message gives, and then named in the ignore list. The Mamba conv1d
    [channels, 1, kernel] beside it is copied as it is."""
    from safetensors.torch import load_file

    src = build_checkpoint(tmp_path / "src", "granitemoehybrid", torch.bfloat16, seed=0)
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "dynamic")
    assert_clean_failure(code, err, out, "'model.layers.0.block_sparse_moe.input_linear.weight'", "fused 3-D",
                         "[4, 512, 256]", "(and 3 more)")
    pattern = re.search(r"--ignore '([^']+)'", err).group(1)
    code, err = run_cli(src, out, "--scheme", "dynamic", "--ignore", pattern)
    assert code == 0, err
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    fused = [f"model.layers.{i}.block_sparse_moe.{p}_linear" for i in range(2) for p in ("input", "output")]
    assert set(fused) <= set(ignore)
    written, source = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
    for name in [f"{m}.weight" for m in fused] + ["model.layers.0.mamba.conv1d.weight"]:
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], source[name]), name
    assert written["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mamba.conv1d" not in ignore


def test_per_tensor_compressed_tensors_moe_is_refused_and_the_alternatives_convert(tmp_path):
    """vLLM's compressed-tensors MoE layers assert on per-tensor weights with per-token activations as the engine
    builds the model (evals/results/vllm_load_moe_schemes_h100.json): refused in one line before anything is written.
    The fp8 format's per-tensor layout (vLLM's Fp8MoEMethod) and an --ignore of every expert are not."""
    src = build_checkpoint(tmp_path / "src", "qwen3_moe", torch.bfloat16, seed=4)
    out = tmp_path / "out"
    code, err = run_cli(src, out, "--scheme", "tensor")
    assert_clean_failure(code, err, out, str(src.resolve()), "expert weights", "model.layers.0.mlp.experts.0.",
                         "--format fp8")
    code, err = run_cli(src, tmp_path / "fp8", "--scheme", "tensor", "--format", "fp8")
    assert code == 0, err
    code, err = run_cli(src, tmp_path / "dense-only", "--scheme", "tensor", "--ignore", r"\.experts\.")
    assert code == 0, err
    ignore = json.loads((tmp_path / "dense-only" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.experts.3.down_proj" in ignore


@pytest.mark.parametrize("scheme", ["dynamic", "tensor-static"])
@pytest.mark.parametrize("broken", ["missing_weight", "config_wider", "config_deeper", "field_type"])
def test_weights_that_do_not_fit_config_json_are_refused(llama_dir, tmp_path, scheme, broken):
    """Converted as they stood, exit 0: a missing weight came out absent (vLLM cannot load it), or, through
    transformers (tensor-static, --kv-cache), initialised at random and calibrated and written as the model's; a
    config of other sizes gave an unloadable checkpoint, or transformers' 35-line load report."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    if broken == "missing_weight":
        tensors = load_file(src / "model.safetensors")
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        needles = [f"{src}: lacks model.layers.1.self_attn.k_proj.weight, which config.json gives the model"]
    elif broken == "config_wider":
        config["intermediate_size"] *= 2
        needles = ["model.layers.0.mlp.gate_proj.weight has shape", "the weights and config.json do not belong"]
    elif broken == "config_deeper":
        config["num_hidden_layers"] += 1
        needles = [f"lacks model.layers.{config['num_hidden_layers'] - 1}.", "more, which config.json gives the model"]
    else:
        config["tie_word_embeddings"] = "false"
        needles = ["config.json: transformers refuses it", "tie_word_embeddings", "fix that field"]
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_clean_failure(*run_cli(src, out, "--scheme", scheme), out, *needles)
