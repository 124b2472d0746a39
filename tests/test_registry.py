"""Registry: catalog resolution, near names, overlay, and ensure() against a locally built HF cache."""

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp8kit.cli import main
from fp8kit.errors import Fp8kitError
from fp8kit.registry import catalog, load, resolve
from fp8kit.registry import resolution as resolve_module
from fp8kit.registry.catalog import Variant
from leftovers import killed_partial

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_every_catalog_entry_resolves_to_itself_and_from_its_bases():
    variants = load()
    assert len(variants) == 40
    repos = {v.repo_id: v for v in variants}
    for v in variants:
        assert resolve(v.repo_id, "auto", variants).repo_id == v.repo_id
        assert resolve(v.repo_id.upper(), "dynamic", variants).repo_id == v.repo_id
        for base in v.base:
            for scheme in ("dynamic", "block"):
                answer = resolve(base.lower(), scheme, variants)
                servers = [w for w in variants if base in w.base and scheme in w.serves]
                if servers:
                    assert answer.repo_id in {w.repo_id for w in servers}
                    assert base in repos[answer.repo_id].base  # never another model's weights
                else:
                    assert answer.repo_id is None and answer.source == "convert"


@pytest.mark.parametrize("name,scheme,expected", [
    ("Qwen/Qwen3-8B", "dynamic", "unsloth/Qwen3-8B-FP8"),
    ("unsloth/Qwen3-8B", "block", "unsloth/Qwen3-8B-FP8"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "dynamic", "unsloth/Llama-3.1-8B-Instruct-FP8-Dynamic"),
    ("unsloth/Meta-Llama-3.1-8B-Instruct", "block", "unsloth/Llama-3.1-8B-Instruct-FP8-Block"),
    ("meta-llama/llama-3.2-1b", "block", "unsloth/Llama-3.2-1B-FP8-Block"),
    ("google/gemma-3-270m-it", "dynamic", "unsloth/gemma-3-270m-it-FP8-Dynamic"),
    ("Qwen/Qwen3-30B-A3B-Thinking-2507", "dynamic", "unsloth/Qwen3-30B-A3B-Thinking-2507-FP8"),
    ("Qwen/Qwen3-VL-8B-Instruct", "block", "unsloth/Qwen3-VL-8B-Instruct-FP8"),
    ("ibm-granite/granite-4.0-h-small", "dynamic", "unsloth/granite-4.0-h-small-FP8-Dynamic"),
    ("mistralai/Magistral-Small-2509", "dynamic", "unsloth/Magistral-Small-2509-FP8-Dynamic"),
])
def test_known_models(name, scheme, expected):
    answer = resolve(name, scheme)
    assert answer.repo_id == expected and answer.source == "catalog"


@pytest.mark.parametrize("name", [
    "Qwen/Qwen3-8B-Base", "Qwen/Qwen3-9B", "Qwen/Qwen3-8", "Qwen/Qwen3-8B-Instruct", "Qwen/Qwen3-8b-instrcut",
    "meta-llama/Llama-3.1-8B-Instruct-v2", "meta-llama/Llama-3.1-405B-Instruct", "meta-llama/Llama-3.2-1B-Instruct-Base",
    "unsloth/Qwen3-8B-FP8-Dynamic", "google/gemma-3-4b-pt", "someone/Qwen3-8B",
    f"Qwen/Qwen3-8B@{COMMIT}",  # a pinned base: the upload was made from some commit, not necessarily this one
])
def test_near_names_never_borrow_a_variant(name):
    answer = resolve(name, "dynamic")
    assert answer.repo_id is None and answer.source == "convert"
    if "@" in name:  # a pinned commit names its cache folder: fp8-convert into it
        assert answer.convert_command.startswith(f"fp8-convert {name} ")
        assert answer.convert_command.endswith("--scheme dynamic")
    else:  # main's commit is not in the (empty) HF cache: ensure() fetches it, then converts
        assert f'ensure("{name}", "dynamic")' in answer.convert_command and "<" not in answer.convert_command


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen/Qwen3-8B/", "./missing-folder", "a/b/c"])
def test_names_that_are_neither_folders_nor_repo_ids_are_refused(name):
    with pytest.raises(Fp8kitError) as e:
        resolve(name, "dynamic")
    assert str(e.value).startswith(f"{name}: no such folder") and "org/name" in str(e.value)
    result = CliRunner().invoke(main, ["resolve", name])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def block_fp8_upload(tmp_path_factory, llama_dir):
    """What the catalog's Qwen uploads hold: block FP8 in the `fp8` format."""
    from fp8kit import convert

    out = tmp_path_factory.mktemp("uploads") / "block-fp8"
    convert(llama_dir, out, scheme="block", format="fp8")
    return out


def test_a_pinned_variant_is_its_own_answer_and_keeps_its_pin(tmp_path, block_fp8_upload):
    answer = resolve(f"unsloth/Qwen3-8B-FP8@{COMMIT}", "block")
    assert answer.repo_id == f"unsloth/Qwen3-8B-FP8@{COMMIT}" and answer.source == "catalog"
    assert resolve("UNSLOTH/qwen3-8b-fp8@main", "block").repo_id == "unsloth/Qwen3-8B-FP8@main"
    # ensure() takes the pinned snapshot from the HF cache (offline) instead of trying to convert an FP8 upload
    cached_repo(tmp_path / "hub", "unsloth/Qwen3-8B-FP8", block_fp8_upload)
    proc = ensure_proc(tmp_path, f"unsloth/Qwen3-8B-FP8@{COMMIT}", "block")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip().endswith(f"models--unsloth--Qwen3-8B-FP8/snapshots/{COMMIT}")


def test_scheme_without_upload_converts():
    assert resolve("google/gemma-3-4b-it", "block").source == "convert"  # gemma uploads are dynamic only
    assert resolve("Qwen/Qwen3-8B", "tensor").source == "convert"


def test_auto_follows_the_machine(monkeypatch):
    monkeypatch.setattr(resolve_module, "has_rowwise_fp8", lambda: True)
    assert resolve("meta-llama/Llama-3.2-3B", "auto").repo_id == "unsloth/Llama-3.2-3B-FP8-Dynamic"
    monkeypatch.setattr(resolve_module, "has_rowwise_fp8", lambda: False)
    assert resolve("meta-llama/Llama-3.2-3B", "auto").repo_id == "unsloth/Llama-3.2-3B-FP8-Block"


def test_overlay_takes_precedence(tmp_path, overlay_text):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(overlay_text + '''
[[variant]]
repo_id = "unsloth/Llama-3.2-1B-FP8-Block"
family = "llama-3.2"
scheme = "block"
format = "fp8"
serves = ["block"]
base = ["meta-llama/Llama-3.2-1B"]
''')
    answer = resolve("Qwen/Qwen3-8B", "dynamic")
    assert (answer.repo_id, answer.source) == ("me/Qwen3-8B-FP8-Dynamic", "overlay")
    assert resolve("Qwen/Qwen3-8B", "block").repo_id == "unsloth/Qwen3-8B-FP8"  # the catalog still serves block
    replaced = resolve("meta-llama/Llama-3.2-1B", "block")
    assert (replaced.format, replaced.source) == ("fp8", "overlay")
    assert sum(v.repo_id == "unsloth/Llama-3.2-1B-FP8-Block" for v in load()) == 1
    catalog.append_to_overlay(Variant("me/gemma-3-4b-it-FP8-Block", "gemma-3", "block", "compressed-tensors",
                                      ("block",), ("google/gemma-3-4b-it",), "overlay"))
    assert resolve("google/gemma-3-4b-it", "block").repo_id == "me/gemma-3-4b-it-FP8-Block"
    assert overlay.read_text().startswith(overlay_text)


@pytest.mark.parametrize("text,line,needle", [
    ('[[variant]]\nrepo_id = "a/b"\nfamily = x\n', 3, "not valid TOML"),
    ('\n[[variant]]\nrepo_id = "a/b"\nfamily = "f"\nscheme = "dynamic"\nformat = "compressed-tensors"\nserves = ["dynamic"]\n'
     'base = ["c/d"]\n\n[[variant]]\nrepo_id = "a/c"\nfamily = "f"\nscheme = "int4"\nformat = "fp8"\n'
     'serves = ["dynamic"]\nbase = ["c/d"]\n', 10, "scheme 'int4'"),
    ('[[variant]]\nrepo_id = "a/b"\nfamily = "f"\nscheme = "dynamic"\nformat = "compressed-tensors"\nserves = ["dynamic"]\n', 1,
     "missing 'base'"),
])
def test_bad_overlay_names_file_and_line(tmp_path, text, line, needle):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(text)
    with pytest.raises(Fp8kitError) as e:
        load()
    assert str(overlay) in str(e.value) and needle in str(e.value)
    assert f"line {line}" in str(e.value) or f"{overlay}:{line}:" in str(e.value)
    result = CliRunner().invoke(main, ["resolve", "Qwen/Qwen3-8B"])
    assert result.exit_code == 1 and str(overlay) in result.stderr and len(result.stderr.splitlines()) == 1


def test_cli_resolve_json():
    result = CliRunner().invoke(main, ["resolve", "Qwen/Qwen3-4B", "--scheme", "block", "--json"])
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("name", "scheme", "repo_id", "format", "source")} == {
        "name": "Qwen/Qwen3-4B", "scheme": "block", "repo_id": "unsloth/Qwen3-4B-FP8", "format": "fp8",
        "source": "catalog"}
    # a variant's own name is its answer: the line says the asked scheme does not apply (it said "answering block")
    result = CliRunner().invoke(main, ["resolve", "unsloth/Qwen3-4B-FP8@abc", "--scheme", "dynamic"])
    assert result.exit_code == 0 and result.stdout.strip() == (
        "unsloth/Qwen3-4B-FP8@abc  (block, fp8; from the catalog; unsloth/Qwen3-4B-FP8@abc is itself a block "
        "variant, so --scheme dynamic does not apply)"), result.output
    result = CliRunner().invoke(main, ["resolve", "unsloth/Qwen3-4B-FP8", "--scheme", "block"])
    assert result.stdout.strip() == ("unsloth/Qwen3-4B-FP8  (block, fp8; from the catalog; unsloth/Qwen3-4B-FP8 is "
                                     "itself a block variant)")
    # auto on a machine without row-wise FP8 picks block; a torchao upload answered "answering block"
    result = CliRunner().invoke(main, ["resolve", "unsloth/Magistral-Small-2509-FP8-torchao"])
    assert result.stdout.strip() == ("unsloth/Magistral-Small-2509-FP8-torchao  (torchao, torchao; from the catalog; "
                                     "unsloth/Magistral-Small-2509-FP8-torchao is itself a torchao variant)")
    result = CliRunner().invoke(main, ["resolve", "Qwen/Qwen3-4B", "--scheme", "block"])
    assert result.stdout.strip() == "unsloth/Qwen3-4B-FP8  (block, fp8; from the catalog, answering block)"
    result = CliRunner().invoke(main, ["registry", "list", "--family", "gemma-3", "--json"])
    assert [v["repo_id"] for v in json.loads(result.stdout)] == [
        f"unsloth/gemma-3-{s}-it-FP8-Dynamic" for s in ("270m", "1b", "4b", "12b", "27b")]


def cached_repo(hub, repo_id, src_dir):
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(src_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


ENSURE = "import sys; from fp8kit.registry import ensure; print(ensure(sys.argv[1], sys.argv[2]))"


def ensure_proc(tmp_path, name, scheme):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", ENSURE, name, scheme], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ensured(tmp_path, name, scheme) -> tuple[int, str, str]:
    """ensure() in a fresh offline process: its exit status, stdout (the path) and stderr."""
    proc = ensure_proc(tmp_path, name, scheme)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.strip(), err


@pytest.fixture
def tiny_with_tokenizer(tmp_path, llama_dir):
    """The tiny Llama with a tokenizer: tensor-static calibrates on text."""
    from fp8kit.models import add_tokenizer

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    add_tokenizer(src, " ".join(f"Sentence {i} tells the quick brown fox to jump." for i in range(120)))
    return src


def test_ensure_variant_from_offline_cache(tmp_path, block_fp8_upload):
    cached_repo(tmp_path / "hub", "unsloth/Qwen3-0.6B-FP8", block_fp8_upload)
    code, out, err = ensured(tmp_path, "Qwen/Qwen3-0.6B", "block")
    assert code == 0, err
    assert out.endswith(f"models--unsloth--Qwen3-0.6B-FP8/snapshots/{COMMIT}")
    code, _, err = ensured(tmp_path, "Qwen/Qwen3-1.7B", "block")  # a variant that is not in the cache
    assert code != 0 and "unsloth/Qwen3-1.7B-FP8" in err and "HF_HUB_OFFLINE" in err


def test_an_upload_that_is_not_what_the_registry_lists_is_refused(tmp_path, llama_dir):
    """A catalog or overlay entry that names the wrong scheme (or an unquantized repo) would hand out weights as
    something they are not; ensure() reads the upload's quantization_config first."""
    from fp8kit import convert

    dynamic = tmp_path / "dynamic"
    convert(llama_dir, dynamic, scheme="dynamic")
    cached_repo(tmp_path / "hub", "unsloth/Qwen3-0.6B-FP8", dynamic)  # listed as block (fp8)
    cached_repo(tmp_path / "hub", "unsloth/Qwen3-1.7B-FP8", llama_dir)  # not quantized at all
    for name, found in (("Qwen/Qwen3-0.6B", "declares dynamic (compressed-tensors)"),
                        ("Qwen/Qwen3-1.7B", "declares no quantization_config")):
        code, _, err = ensured(tmp_path, name, "block")
        assert code != 0 and "Fp8kitError: unsloth/Qwen3-" in err, err
        assert "the shipped catalog lists it as block (fp8)" in err and found in err, err


def test_a_tensor_static_upload_is_fetched_as_tensor_static_and_never_as_tensor(tmp_path, tiny_with_tokenizer,
                                                                                 monkeypatch):
    """What `fp8kit publish --scheme tensor-static` registers: its config.json declares per-tensor weights with static
    activation scales, which ensure() read as `tensor` and refused; listed as `tensor`, the same upload passed."""
    pytest.importorskip("llmcompressor")
    from fp8kit import convert

    static = tmp_path / "static"
    convert(tiny_with_tokenizer, static, scheme="tensor-static")
    cached_repo(tmp_path / "hub", "me/tiny-FP8-Tensor-Static", static)
    cached_repo(tmp_path / "hub", "me/tiny-FP8-Tensor", static)
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("".join(f'[[variant]]\nrepo_id = "me/tiny-FP8-{name}"\nfamily = "tiny"\nscheme = "{scheme}"\n'
                               f'format = "compressed-tensors"\nserves = ["{scheme}"]\nbase = ["org/tiny"]\n'
                               for name, scheme in (("Tensor-Static", "tensor-static"), ("Tensor", "tensor"))))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(overlay))
    # the GRPO runtime with vLLM refuses it by name, before downloading it; its base is converted per channel
    from fp8kit.errors import Fp8kitError
    from fp8kit.registry import resolve
    from fp8kit.rl.model import check_not_static_upload

    with pytest.raises(Fp8kitError, match=r"^me/tiny-FP8-Tensor-Static: registered with static activation scales"):
        check_not_static_upload(resolve("me/tiny-FP8-Tensor-Static", "dynamic"))
    check_not_static_upload(resolve("org/tiny", "dynamic"))
    upload = f"models--me--tiny-FP8-Tensor-Static/snapshots/{COMMIT}"
    code, out, err = ensured(tmp_path, "me/tiny-FP8-Tensor-Static", "auto")
    assert code == 0 and out.endswith(upload), err
    code, out, err = ensured(tmp_path, "org/tiny", "tensor-static")  # the base name asks for it by scheme
    assert code == 0 and out.endswith(upload), err
    code, _, err = ensured(tmp_path, "org/tiny", "tensor")
    assert code != 0, err
    assert ("the registry overlay (FP8KIT_REGISTRY) lists it as tensor (compressed-tensors), but its config.json "
            "declares tensor-static (compressed-tensors)") in err, err


def test_static_activation_scales_on_channel_weights_answer_no_request(tmp_path, llama_dir):
    """An upload with per-channel weights and static input scales (vLLM serves it) listed as dynamic passed ensure():
    a dynamic request got static activations, which the GRPO runtime's trainer does not compute."""
    from fp8kit import convert
    from fp8kit.registry.cache import check_upload
    from fp8kit.registry.resolution import Resolution

    upload = tmp_path / "upload"
    convert(llama_dir, upload, scheme="dynamic")
    answer = Resolution(name="org/tiny", scheme="dynamic", repo_id="me/tiny-FP8-Dynamic", format="compressed-tensors",
                        source="overlay", variant_scheme="dynamic")
    check_upload(upload, answer)  # as converted: dynamic
    config = json.loads((upload / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"].update(dynamic=False, strategy="tensor")
    (upload / "config.json").write_text(json.dumps(config))
    with pytest.raises(Fp8kitError, match=r"^me/tiny-FP8-Dynamic: the registry overlay \(FP8KIT_REGISTRY\) lists it as "
                                          r"dynamic \(compressed-tensors\), but its config.json declares per-channel weights "
                                          r"with static activation scales \(compressed-tensors\)"):
        check_upload(upload, answer)


LOAD_SCHEMES = """
import sys, torch
from fp8kit.errors import Fp8kitError
from fp8kit.rl import load_model
for name, fp8 in (("me/tiny-FP8-Dynamic", False), ("me/tiny-FP8-Dynamic", "block"), ("me/tiny-FP8-Block", False),
                  ("someone/tiny-FP8", False), ("someone/tiny-FP8", "block"), ("me/tiny-FP8-Dynamic", True),
                  ("someone/tiny-FP8", True), ("someone/tiny-null", True)):
    try:
        model, _ = load_model(name, load_in_fp8=fp8, dtype=torch.float32, lora_rank=4, fast_inference=False,
                              device="cpu")
        print("loaded", model.fp8_scheme)
    except Fp8kitError as e:
        print(e)
"""


def test_load_in_fp8_false_or_block_refuses_an_fp8_upload_by_name_before_downloading_it(tmp_path,
                                                                                       tiny_with_tokenizer):
    """load_model('me/tiny-FP8-Dynamic', load_in_fp8=False) loaded the FP8 upload as the full-precision baseline
    (and 'block' loaded it as it was), where a local FP8 folder was refused. A registered upload is refused by its
    listed scheme before it is downloaded (me/tiny-FP8-Block is not in the HF cache: offline, the download would
    fail), an unlisted FP8 repo once its config.json is read. An unlisted FP8 repo loads as it is with load_in_fp8=True
    (the converter refused it as already quantized)."""
    from fp8kit import convert

    dynamic = tmp_path / "dynamic"
    convert(tiny_with_tokenizer, dynamic, scheme="dynamic")
    cached_repo(tmp_path / "hub", "me/tiny-FP8-Dynamic", dynamic)
    cached_repo(tmp_path / "hub", "someone/tiny-FP8", dynamic)
    null = tmp_path / "null"  # `"quantization_config": null`: no FP8 weights, and not an original to convert either
    shutil.copytree(tiny_with_tokenizer, null)
    config = json.loads((null / "config.json").read_text())
    (null / "config.json").write_text(json.dumps({**config, "quantization_config": None}))
    cached_repo(tmp_path / "hub", "someone/tiny-null", null)
    cached_repo(tmp_path / "hub", "org/tiny", tiny_with_tokenizer)
    (tmp_path / "overlay.toml").write_text(
        "".join(f'[[variant]]\nrepo_id = "me/tiny-FP8-{name}"\nfamily = "tiny"\nscheme = "{scheme}"\n'
                f'format = "compressed-tensors"\nserves = ["{scheme}"]\nbase = ["org/tiny"]\n'
                for name, scheme in (("Dynamic", "dynamic"), ("Block", "block"))))
    proc = subprocess.run([sys.executable, "-c", LOAD_SCHEMES], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    snapshot = tmp_path / "hub" / "models--someone--tiny-FP8" / "snapshots" / COMMIT
    assert proc.stdout.splitlines() == [
        "me/tiny-FP8-Dynamic: already an FP8 checkpoint (dynamic); the load_in_fp8=False baseline needs the original "
        "model",
        "me/tiny-FP8-Dynamic: a dynamic FP8 checkpoint, not block; pass load_in_fp8=True or the original model to "
        "convert",
        "me/tiny-FP8-Block: already an FP8 checkpoint (block); the load_in_fp8=False baseline needs the original model",
        f"{snapshot}: already an FP8 checkpoint (dynamic); the load_in_fp8=False baseline needs the original model",
        f"{snapshot}: a dynamic FP8 checkpoint, not block; pass load_in_fp8=True or the original model to convert",
        "loaded dynamic", "loaded dynamic",
        f"{tmp_path / 'hub' / 'models--someone--tiny-null' / 'snapshots' / COMMIT / 'config.json'}: checkpoint is "
        f"already quantized (quant_method unknown); convert the original BF16/FP16/FP32 checkpoint instead"], proc.stdout
    # a broken overlay fails what reads the registry, not the full-precision baseline of a Hub name
    (tmp_path / "overlay.toml").write_text("[[variant]]\nrepo_id = 1\n")
    script = ("import torch; from fp8kit.rl import load_model; m, _ = load_model('org/tiny', load_in_fp8=False, "
              "dtype=torch.float32, lora_rank=4, fast_inference=False, device='cpu'); print(m.fp8_scheme)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


def test_tensor_static_is_converted_once_and_cached_with_the_shipped_sample(tmp_path, tiny_with_tokenizer):
    """`resolve --scheme tensor-static` without an upload plans the conversion (calibrated on the shipped sample), and
    ensure() makes it once: the fastest vLLM layout by name, as the other schemes are."""
    pytest.importorskip("llmcompressor")
    from fp8kit.quality import static_activations
    from fp8kit.registry import ensure

    src = tiny_with_tokenizer
    result = CliRunner().invoke(main, ["resolve", str(src), "--scheme", "tensor-static"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"no upload for {src} (tensor-static); will convert and cache:")
    assert "--scheme tensor-static" in result.stdout
    entry = ensure(str(src), "tensor-static")
    assert entry.name.startswith("tensor-static-compressed-tensors-fp8kit")
    assert static_activations(json.loads((entry / "config.json").read_text())["quantization_config"])
    assert ensure(str(src), "tensor-static") == entry  # cached: not converted again
    log = (tmp_path / "fp8cache" / "conversions.log").read_text().splitlines()
    assert len(log) == 1 and " tensor-static -> " in log[0], log
    result = CliRunner().invoke(main, ["resolve", str(src), "--scheme", "tensor-static", "--json"])
    assert json.loads(result.stdout)["cached"] is True and json.loads(result.stdout)["cache_dir"] == str(entry)
    from fp8kit.converter import calibration

    def no_tokenizer(path, why):
        raise Fp8kitError(f"{path}: {why} needs the model's tokenizer")

    with pytest.MonkeyPatch.context() as patch:  # a tokenizer that stopped loading: the cached conversion still serves
        patch.setattr(calibration, "calibration_tokenizer", no_tokenizer)
        assert resolve(str(src), "tensor-static").cached and ensure(str(src), "tensor-static") == entry
    # without a tokenizer the planned conversion could only fail: said at once, as for the other inputs it refuses
    for f in [*src.glob("tokenizer*"), *src.glob("special_tokens_map.json")]:
        f.unlink()
    result = CliRunner().invoke(main, ["resolve", str(src), "--scheme", "tensor-static"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "--scheme tensor-static needs the model's tokenizer to calibrate" in result.stderr, result.stderr


def test_ensure_converts_once_even_when_raced(tmp_path, llama_dir):
    cached_repo(tmp_path / "hub", "fp8kit-test/tiny-llama", llama_dir)
    procs = [ensure_proc(tmp_path, "fp8kit-test/tiny-llama", "dynamic") for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    entry = tmp_path / "fp8cache" / "fp8kit-test--tiny-llama" / COMMIT / "dynamic-compressed-tensors-fp8kit0.1.0"
    assert paths == {str(entry)}
    log = (tmp_path / "fp8cache" / "conversions.log").read_text().splitlines()
    assert len(log) == 1
    assert (entry / "model.safetensors").exists() and (entry / "fp8kit-entry.json").exists()

    # a damaged entry is rebuilt; an entry without its completion marker is redone
    (entry / "model.safetensors").write_bytes(b"garbage")
    p = ensure_proc(tmp_path, "fp8kit-test/tiny-llama", "dynamic")
    assert p.communicate(timeout=120)[0].strip() == str(entry) and p.returncode == 0
    (entry / "fp8kit-entry.json").unlink()
    p = ensure_proc(tmp_path, "fp8kit-test/tiny-llama", "dynamic")
    p.communicate(timeout=120)
    assert len((tmp_path / "fp8cache" / "conversions.log").read_text().splitlines()) == 3
    from safetensors import safe_open

    with safe_open(entry / "model.safetensors", "pt") as f:
        assert str(f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype()) == "F8_E4M3"

    runner = CliRunner()
    listing = json.loads(runner.invoke(main, ["cache", "list", "--json"]).stdout)
    assert [(r["name"], r["scheme"], r["commit"], r["ok"]) for r in listing] == [
        ("fp8kit-test/tiny-llama", "dynamic", COMMIT, True)]
    result = runner.invoke(main, ["cache", "rm", "fp8kit-test/tiny-llama"])
    assert result.exit_code == 0 and not entry.exists()
    assert json.loads(runner.invoke(main, ["cache", "list", "--json"]).stdout) == []


def test_local_checkpoint_in_a_snapshots_folder_is_keyed_by_its_files(tmp_path):
    """Only the HF cache's snapshots are keyed by folder name: one's own `snapshots/<name>` retrained in place
    gets a new entry, not the old conversion."""
    from fp8kit.models import build_checkpoint

    ckpt = tmp_path / "runs" / "snapshots" / "my-finetune"
    build_checkpoint(ckpt, "llama", torch.bfloat16, seed=1)
    first = ensure_proc(tmp_path, str(ckpt), "dynamic").communicate(timeout=120)[0].strip()
    shutil.rmtree(ckpt)
    build_checkpoint(ckpt, "llama", torch.bfloat16, seed=2)
    second = ensure_proc(tmp_path, str(ckpt), "dynamic").communicate(timeout=120)[0].strip()
    assert Path(first).parent.name.startswith("local-") and Path(second).parent.name.startswith("local-")
    assert first != second


def test_local_directory_is_never_answered_from_the_catalog(tmp_path, llama_dir, monkeypatch):
    local = tmp_path / "Qwen" / "Qwen3-8B"
    shutil.copytree(llama_dir, local)
    monkeypatch.chdir(tmp_path)
    answer = resolve("Qwen/Qwen3-8B", "dynamic")
    assert answer.repo_id is None and answer.source == "convert"


def test_cache_rm_all_removes_only_fp8kit_entries(tmp_path):
    root = tmp_path / "fp8cache"
    (root / "someone-else" / "data").mkdir(parents=True)
    (root / "someone-else" / "data" / "state.lock").write_text("x")  # another tool's lock: not an entry lock
    entry = root / "org--m" / COMMIT / "dynamic-compressed-tensors-fp8kit0.1.0"
    entry.mkdir(parents=True)
    (entry / "fp8kit-entry.json").write_text("not json")
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    assert listing.exit_code == 0 and json.loads(listing.stdout)[0]["ok"] is False
    both = CliRunner().invoke(main, ["cache", "rm", "org/m", "--all"])  # said "give a model NAME or --all"
    assert both.exit_code == 2 and both.stderr == "error: give a model NAME or --all, not both\n" and entry.exists()
    neither = CliRunner().invoke(main, ["cache", "rm"])
    assert neither.exit_code == 2 and neither.stderr == "error: give a model NAME or --all\n"
    result = CliRunner().invoke(main, ["cache", "rm", "--all"])
    assert result.exit_code == 0
    assert (root / "someone-else" / "data").exists() and not (root / "org--m").exists()


def test_catalog_errors_count_commented_headers_and_reject_non_tables(tmp_path):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('[[variant]] # mine\nrepo_id = "a/b"\nfamily = "f"\nscheme = "int4"\nformat = "fp8"\n'
                       'serves = ["dynamic"]\nbase = ["c/d"]\n')
    with pytest.raises(Fp8kitError, match=f"{overlay}:1: scheme 'int4'"):
        load()
    good = '[[variant]]\nrepo_id = "a/ok"\nfamily = "f"\nscheme = "dynamic"\nformat = "compressed-tensors"\nserves = ["dynamic"]\n' \
           'base = ["c/d"]\n'
    for header in ("[[\tvariant]]", '[["variant"]]', "[[ 'variant' ]]"):  # valid TOML headers: the error is on line 8
        overlay.write_text(good + header + '\nrepo_id = "a/b"\nfamily = "f"\nscheme = "int4"\nformat = "fp8"\n'
                           'serves = ["dynamic"]\nbase = ["c/d"]\n')
        with pytest.raises(Fp8kitError, match=f"{overlay}:8: scheme 'int4'"):
            load()
    overlay.write_text("variant = [1]\n")
    with pytest.raises(Fp8kitError, match="must be a \\[\\[variant\\]\\] table"):
        load()


def test_cache_rm_of_a_linked_model_folder_removes_the_link_not_its_target(tmp_path):
    root = tmp_path / "fp8cache"
    root.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    entry = elsewhere / COMMIT / "dynamic-compressed-tensors-fp8kit0.1.0"
    entry.mkdir(parents=True)
    (entry / "fp8kit-entry.json").write_text("{}")
    (root / "org--m").symlink_to(elsewhere, target_is_directory=True)
    everything = CliRunner().invoke(main, ["cache", "rm", "--all"])  # --all removes only real folders of ours
    assert everything.exit_code == 0 and (root / "org--m").is_symlink()
    result = CliRunner().invoke(main, ["cache", "rm", "org/m"])
    assert result.exit_code == 0, result.output
    assert not (root / "org--m").exists() and not (root / "org--m").is_symlink()
    assert (entry / "fp8kit-entry.json").read_text() == "{}"


def test_appended_entries_escape_what_toml_would_misread(tmp_path):
    """A family with a quote was appended as `family = "tiny "dev""`: every registry command then failed."""
    family = 'tiny "dev" \\ tab\there \x7f \u00e9 \U0001f600'
    catalog.append_to_overlay(Variant("me/tiny-FP8", family, "dynamic", "compressed-tensors", ("dynamic",),
                                      ("org/tiny",), "overlay"))
    [mine] = [v for v in load() if v.source == "overlay"]
    assert mine.family == family and mine.repo_id == "me/tiny-FP8"


def test_cache_rm_of_a_relative_name_removes_only_that_folder_s_conversion(tmp_path, llama_dir, monkeypatch):
    """Two projects with a checkpoint folder of the same name: `cache rm ckpt` in one removed both."""
    from fp8kit.registry import ensure

    entries = {}
    for project in ("projA", "projB"):
        shutil.copytree(llama_dir, tmp_path / project / "ckpt")
        monkeypatch.chdir(tmp_path / project)
        entries[project] = ensure("ckpt", "dynamic")
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    assert sorted(row["name"] for row in json.loads(listing.stdout)) == [str(tmp_path / p / "ckpt") for p in entries]
    monkeypatch.chdir(tmp_path / "projA")
    result = CliRunner().invoke(main, ["cache", "rm", "ckpt"])
    assert result.exit_code == 0, result.output
    assert not entries["projA"].exists() and (entries["projB"] / "fp8kit-entry.json").exists()


class _LockRefused:
    """filelock on a cache folder this user cannot write."""

    def __init__(self, path):
        self.path = path

    def acquire(self):
        raise PermissionError(13, "Permission denied", str(self.path))


def test_read_only_cache_serves_complete_entries_and_refuses_new_ones_in_one_line(tmp_path, llama_dir, monkeypatch):
    """Both once died in a PermissionError traceback: the lock was taken before a complete entry was checked."""
    from fp8kit.registry import cache, ensure

    made = ensure(str(llama_dir), "dynamic")
    monkeypatch.setattr(cache, "FileLock", _LockRefused)
    assert ensure(str(llama_dir), "dynamic") == made
    with pytest.raises(Fp8kitError) as e:
        ensure(str(llama_dir), "block")
    message = str(e.value)
    assert "\n" not in message and f"cache {tmp_path / 'fp8cache'}: cannot write there" in message
    assert "FP8KIT_CACHE" in message and not any(p.name.startswith("block") for p in made.parent.iterdir())


def test_cache_rm_leaves_a_conversion_that_is_running(tmp_path):
    """`cache rm NAME` and `--all` deleted the folder a live conversion was writing (it then failed with 'cannot
    write'); now a held entry lock keeps its model folder, and the command says so in one line."""
    from filelock import FileLock

    root = tmp_path / "fp8cache"
    busy = root / "org--busy" / COMMIT
    busy.mkdir(parents=True)
    killed_partial(busy / ".dynamic-compressed-tensors-fp8kit0.1.0.partial-abc")
    idle = root / "org--idle" / COMMIT / "dynamic-compressed-tensors-fp8kit0.1.0"
    idle.mkdir(parents=True)
    (idle.parent / "dynamic-compressed-tensors-fp8kit0.1.0.lock").write_text("")
    with FileLock(busy / "dynamic-compressed-tensors-fp8kit0.1.0.lock"):
        for args in (["org/busy"], ["--all"]):
            result = CliRunner().invoke(main, ["cache", "rm", *args])
            assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "org--busy: a conversion is running there" in result.stderr
            assert busy.is_dir()
        assert not (root / "org--idle").exists()  # --all removed what was not busy
    result = CliRunner().invoke(main, ["cache", "rm", "org/busy"])
    assert result.exit_code == 0 and not (root / "org--busy").exists()


@pytest.mark.parametrize("field,value,needle", [
    ("repo_id", "me/M-FP8\\n", "repo_id"), ("repo_id", "me/..", "repo_id"), ("base", "[\"me/a--b\"]", "base"),
    ("serves", "[\"block\"]", "does not fit scheme 'dynamic'"), ("format", "\"fp8\"", "does not hold scheme"),
    # static activation scales answer no dynamic request (the GRPO runtime refuses them)
    ("scheme", "tensor-static", "serves ['dynamic'] does not fit scheme 'tensor-static'; list 'tensor-static' and "
                                "at most nothing else"),
])
def test_overlay_entries_the_hub_or_the_schemes_cannot_honour_are_refused(tmp_path, field, value, needle):
    fields = {"repo_id": '"me/M-FP8"', "family": '"m"', "scheme": '"dynamic"', "format": '"compressed-tensors"',
              "serves": '["dynamic"]', "base": '["me/M"]'}
    fields[field] = value if value.startswith(("[", '"')) else f'"{value}"'
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("[[variant]]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()))
    with pytest.raises(Fp8kitError, match=f"{overlay}:1: .*{re.escape(needle)}"):
        load()
    if field == "scheme":
        overlay.write_text(overlay.read_text().replace('["dynamic"]', '["tensor-static"]'))
        assert [v.scheme for v in load() if v.repo_id == "me/M-FP8"] == ["tensor-static"]
        overlay.write_text(overlay.read_text().replace('"compressed-tensors"', '"fp8"'))  # activation_scheme static
        assert [v.format for v in load() if v.repo_id == "me/M-FP8"] == ["fp8"]
        overlay.write_text(overlay.read_text().replace('"fp8"', '"torchao"'))
        with pytest.raises(Fp8kitError, match="format 'torchao' does not hold scheme 'tensor-static'"):
            load()


def test_inline_overlay_arrays_name_the_entry_not_a_wrong_line(tmp_path):
    overlay = tmp_path / "overlay.toml"
    good = '{repo_id = "a/ok", family = "f", scheme = "dynamic", format = "compressed-tensors", serves = ["dynamic"], ' \
           'base = ["c/d"]}'
    bad = good.replace("a/ok", "a/b").replace('scheme = "dynamic"', 'scheme = "x"')
    overlay.write_text(f"variant = [{good},\n{bad}]\n")
    with pytest.raises(Fp8kitError, match=f"{overlay}: variant 2: scheme 'x'"):
        load()


def test_a_pasted_name_with_spaces_is_used_stripped():
    answer = resolve("  Qwen/Qwen3-8B-Base \n", "dynamic")
    assert answer.name == "Qwen/Qwen3-8B-Base" and 'ensure("Qwen/Qwen3-8B-Base", ' in answer.convert_command
    assert answer.model_dir.endswith("Qwen--Qwen3-8B-Base") and answer.cache_dir is None  # commit not known


def test_a_marker_edited_into_another_shape_is_rebuilt(tmp_path, llama_dir):
    out = ensure_proc(tmp_path, str(llama_dir), "dynamic").communicate(timeout=120)[0].strip()
    marker = Path(out) / "fp8kit-entry.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "files": list(info["files"]), "name": [info["name"]]}))
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    assert listing.exit_code == 0 and [r["ok"] for r in json.loads(listing.stdout)] == [False], listing.output
    listing = CliRunner().invoke(main, ["cache", "list"])  # a name that is not a string: shown as unknown
    assert listing.exit_code == 0 and listing.stdout.startswith("? ") and "BROKEN" in listing.stdout, listing.output
    proc = ensure_proc(tmp_path, str(llama_dir), "dynamic")
    assert proc.communicate(timeout=120)[0].strip() == out and proc.returncode == 0
    assert isinstance(json.loads(marker.read_text())["files"], dict)  # converted again


def test_an_unfinished_conversion_of_a_local_checkpoint_is_listed_by_its_path(tmp_path, llama_dir):
    """A local conversion killed outright had no completion marker beside it to name it: `cache list` showed no
    NAME for `cache rm`."""
    from fp8kit.registry.cache import cached_conversion, entry_name, model_dir

    local = tmp_path / "mine"
    shutil.copytree(llama_dir, local)
    entry = Path(cached_conversion(str(local), "dynamic"))
    shutil.rmtree(entry)  # as if the first conversion had been killed: only its temporary folder is left
    stale = killed_partial(entry.parent / f".{entry_name('dynamic')}.partial-killed")
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    [row] = json.loads(listing.stdout)
    assert (row["name"], row["status"], row["path"]) == (str(local.resolve()), "unfinished", str(stale))
    result = CliRunner().invoke(main, ["cache", "rm", str(local)])
    assert result.exit_code == 0 and not model_dir(str(local)).exists(), result.output


def test_a_conversion_waiting_while_cache_rm_removes_its_folder_starts_again(tmp_path, llama_dir, monkeypatch):
    """`cache rm` deletes a model folder while holding its locks; a conversion waiting on one then found its lock
    file gone (FileNotFoundError) and reported that the cache could not be written."""
    import fp8kit.registry.cache as cache
    from filelock import FileLock

    calls = []

    class RemovedWhileWaiting(FileLock):
        def acquire(self, *args, **kwargs):
            if not calls:
                calls.append(self.lock_file)
                shutil.rmtree(Path(self.lock_file).parent.parent)  # what cache rm does meanwhile
                raise FileNotFoundError(2, "No such file or directory", self.lock_file)
            return super().acquire(*args, **kwargs)

    monkeypatch.setattr(cache, "FileLock", RemovedWhileWaiting)
    entry = cache.cached_conversion(str(llama_dir), "dynamic")
    assert calls and cache.verify(entry)


INLINE_ENTRY = ('{ repo_id = "me/Qwen3-8B-FP8-Dynamic", family = "qwen3", scheme = "dynamic", '
                'format = "compressed-tensors", serves = ["dynamic"], base = ["Qwen/Qwen3-8B"] }')


@pytest.mark.parametrize("text", [
    f"# my uploads\nvariant = [\n  {INLINE_ENTRY},\n]\n",  # a trailing comma, one entry a line
    f"# my uploads\nvariant = [\n  {INLINE_ENTRY} # the 8B [mine]\n] # end\n",  # brackets in comments, no comma
    f"# my uploads\nvariant = [{INLINE_ENTRY}]",  # one line, no newline at the end
    "# my uploads\nvariant = []\n",
], ids=["trailing-comma", "comments", "one-line", "empty"])
def test_registering_into_an_inline_overlay_keeps_it_readable(tmp_path, text):
    """README accepts `variant = [...]`; a [[variant]] table appended after it is invalid TOML, so publishing one
    upload broke every registry command. The entry now goes into the array, and the file keeps its comments."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(text)
    before = [v.repo_id for v in load() if v.source == "overlay"]
    for name in ("me/tiny-FP8-Dynamic", "me/tiny-FP8-Block"):
        scheme = name.rsplit("-", 1)[1].lower()
        catalog.append_to_overlay(Variant(name, "tiny", scheme, "compressed-tensors", (scheme,), ("org/tiny",),
                                          "overlay"))
    assert [v.repo_id for v in load() if v.source == "overlay"] == before + ["me/tiny-FP8-Dynamic", "me/tiny-FP8-Block"]
    written = overlay.read_text()
    assert "[[variant]]" not in written and written.startswith("# my uploads\nvariant = [")
    assert resolve("org/tiny", "block").repo_id == "me/tiny-FP8-Block"
    result = CliRunner().invoke(main, ["registry", "list", "--family", "tiny"])
    assert result.exit_code == 0 and "me/tiny-FP8-Dynamic" in result.stdout, result.output


def test_an_entry_no_placement_reads_back_is_refused_not_written(tmp_path):
    """Each place the entry could go is parsed back; where none reads as the old entries plus the new one, the
    text is refused (append_to_overlay's read_file refuses such a file first, so _with_entry is called directly)."""
    from fp8kit.errors import Fp8kitError

    fields = Variant("me/tiny-FP8-Dynamic", "tiny", "dynamic", "compressed-tensors", ("dynamic",), ("org/tiny",),
                     "overlay").to_dict()
    fields.pop("source")
    with pytest.raises(Fp8kitError, match=r"overlay.toml: cannot add me/tiny-FP8-Dynamic to this overlay; write its "
                                          r"entries as \[\[variant\]\] tables"):
        catalog._with_entry('variant = "not a list"\n', fields, tmp_path / "overlay.toml")


def test_resolve_of_a_cached_conversion_says_where_it_is(tmp_path, llama_dir):
    """It said "will convert" and printed an fp8-convert command that fails on the existing folder."""
    from fp8kit.registry import ensure

    entry = ensure(str(llama_dir), "dynamic")
    answer = resolve(str(llama_dir), "dynamic")
    assert answer.cached and answer.cache_dir == str(entry) and answer.convert_command is None
    result = CliRunner().invoke(main, ["resolve", str(llama_dir), "--scheme", "dynamic"])
    assert result.exit_code == 0 and str(entry) in result.stdout and "cached" in result.stdout, result.output
    assert "fp8-convert" not in result.stdout and "will convert" not in result.stdout
    fresh = resolve(str(llama_dir), "block")  # another scheme of it is not cached
    assert not fresh.cached and fresh.convert_command.startswith("fp8-convert ")


def test_a_broken_cached_entry_gets_a_command_that_replaces_it(tmp_path, llama_dir):
    """An entry whose files no longer match its marker is rebuilt by ensure(); the command resolve printed for it
    failed on the existing folder (no --overwrite)."""
    import shlex

    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure

    entry = ensure(str(llama_dir), "dynamic")
    with open(entry / "config.json", "a") as f:
        f.write(" ")
    answer = resolve(str(llama_dir), "dynamic")
    assert not answer.cached and answer.convert_command.endswith("--overwrite"), answer.convert_command
    result = CliRunner().invoke(fp8_convert, shlex.split(answer.convert_command)[1:])
    assert result.exit_code == 0, result.output
    assert resolve(str(llama_dir), "dynamic").cached


def test_a_pasted_local_path_with_spaces_is_the_local_checkpoint(tmp_path, llama_dir, monkeypatch):
    """A folder named like a catalogued Hub id is converted, typed or pasted with stray spaces; pasted, the spaces
    sent it to the catalog's upload of another model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen").mkdir()
    shutil.copytree(llama_dir, tmp_path / "Qwen" / "Qwen3-8B")
    for typed in ("Qwen/Qwen3-8B", " Qwen/Qwen3-8B \n", "./Qwen/Qwen3-8B "):
        answer = resolve(typed, "dynamic")
        assert answer.source == "convert" and answer.repo_id is None and answer.name == typed.strip(), answer


def test_an_overlay_listing_one_repo_twice_is_refused(tmp_path, monkeypatch):
    """resolve answered with the first entry and publish checked against the last: a dynamic upload could land under
    a repo id resolve calls block."""
    overlay = tmp_path / "overlay.toml"
    entry = ('[[variant]]\nrepo_id = "{repo}"\nfamily = "tiny"\nscheme = "{scheme}"\nformat = "compressed-tensors"\n'
             'serves = ["{scheme}"]\nbase = ["myorg/tiny"]\n')
    overlay.write_text(entry.format(repo="myorg/tiny-FP8", scheme="block") + "\n" +
                       entry.format(repo="MyOrg/Tiny-FP8", scheme="dynamic"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(overlay))
    result = CliRunner().invoke(main, ["resolve", "myorg/tiny-FP8"])
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: {overlay}:9: MyOrg/Tiny-FP8 is listed already ({overlay}:1); keep one entry for it"), result.output


def test_a_file_cache_rm_cannot_delete_is_one_line(tmp_path, llama_dir, monkeypatch):
    """A file rmtree cannot delete (an immutable flag, a read-only mount) stopped `cache rm` with a traceback."""
    from fp8kit.registry import ensure
    from fp8kit.registry import cache as cache_module

    entry = ensure(str(llama_dir), "dynamic")

    def refuse(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(Path(path) / "config.json"))

    monkeypatch.setattr(cache_module.shutil, "rmtree", refuse)
    result = CliRunner().invoke(main, ["cache", "rm", str(llama_dir)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "config.json: cannot delete (Operation not permitted)" in lines[0]
    assert str(entry.parent.parent) in lines[0]


def test_models_loaded_by_hub_name_name_their_adapters_base_by_it(tmp_path, llama_dir):
    """load_fp8_model('me/tiny') recorded its cached conversion's folder as the adapter's base: peft on another
    machine (or after `fp8kit cache rm`) could not open it. load_model records the name; so does it now."""
    cached_repo(tmp_path / "hub", "me/tiny", llama_dir)
    script = ("import sys, torch; from fp8kit.rl import load_fp8_model, save_adapter; "
              "m = load_fp8_model('me/tiny', dtype=torch.float32, lora_rank=4); print(m.name_or_path); "
              "save_adapter(m, sys.argv[1])")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "adapter")], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "me/tiny", result.stderr
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "me/tiny"
