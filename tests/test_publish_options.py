"""fp8kit publish with fp8-convert's options (--kv-cache fp8, --calibration, --lm-head, --ignore): converted for the
run instead of taken from the cache, validated with them, described on the card and in fp8kit.json, and checked
before any work."""

import hashlib
import json
import shutil

import pytest
from click.testing import CliRunner
from huggingface_hub import ModelCard
from safetensors import safe_open

from fp8kit.cli import main
from fp8kit.models import add_tokenizer
from test_publish import SOURCE_CARD, hub, publish, results  # noqa: F401 - hub is a fixture
from test_publish_errors import GOOD, one_line_error

TEXT = " ".join(f"Sentence {i} tells the quick brown fox to jump over {i % 7} lazy dogs." for i in range(120))


@pytest.fixture
def src(tmp_path, llama_dir):
    """The tiny Llama with a tokenizer (KV-cache calibration runs the model on text) and an untied lm_head."""
    path = tmp_path / "tiny-llama"
    shutil.copytree(llama_dir, path)
    (path / "README.md").write_text(SOURCE_CARD)
    add_tokenizer(path, TEXT)
    (tmp_path / "calib.txt").write_text(TEXT)
    return path


def tensors(data: bytes, tmp_path) -> dict:
    f = tmp_path / "downloaded.safetensors"
    f.write_bytes(data)
    with safe_open(f, "pt") as sf:
        return {k: sf.get_tensor(k) for k in sf.keys()}


def test_kv_cache_lm_head_and_ignore_are_published_described_and_rerun_unchanged(tmp_path, hub, src):
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--kv-cache", "fp8", "--calibration",
            tmp_path / "calib.txt", "--lm-head", "--ignore", r"layers\.1\.mlp\.down_proj", "--json"]
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    out = results(proc)["tester/tiny-FP8-Dynamic"]
    assert out["status"] == "uploaded" and out["metrics"]["kl"] < 5e-3, out

    repo = "tester/tiny-FP8-Dynamic"
    qc = json.loads(hub.file(repo, "config.json"))["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["num_bits"] == 8
    assert "lm_head" not in qc["ignore"] and "model.layers.1.mlp.down_proj" in qc["ignore"]
    index = json.loads(hub.file(repo, "model.safetensors.index.json"))["weight_map"]  # the scales: their own shard
    weights = {}
    for shard in sorted(set(index.values())):
        weights.update(tensors(hub.file(repo, shard), tmp_path))
    assert weights["model.layers.0.self_attn.k_scale"].numel() == 1 and "model.layers.1.self_attn.v_scale" in weights
    assert weights["lm_head.weight"].dtype.itemsize == 1 and "lm_head.weight_scale" in weights
    assert weights["model.layers.1.mlp.down_proj.weight"].dtype.itemsize == 2
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype.itemsize == 1

    provenance = json.loads(hub.file(repo, "fp8kit.json"))
    assert provenance["kv_cache"] == "fp8" and provenance["lm_head"] is True
    assert provenance["ignore"] == [r"layers\.1\.mlp\.down_proj"]
    assert provenance["calibration"] == {"file": "calib.txt", "sha256": hashlib.sha256(TEXT.encode()).hexdigest()}
    card = ModelCard(hub.file(repo, "README.md").decode()).text
    assert "KV cache: FP8 scales" in card and "calibrated on calib.txt" in card and "--kv-cache-dtype" in card
    assert "`lm_head` is FP8 too" in card and r"matching `layers\.1\.mlp\.down_proj`" in card
    assert (r"--kv-cache fp8 --calibration calib.txt --lm-head --ignore 'layers\.1\.mlp\.down_proj'" in card
            and str(tmp_path / "calib.txt") not in card)  # the calibration file by name
    # converted for this run: the cache holds no conversion, and no temporary folder is left
    assert not list((tmp_path / "fp8cache").glob("*/*/dynamic-*"))
    assert not list((tmp_path / "tmp").iterdir())

    commits = sum(1 for m, p in hub.requests if "/commit/" in p)
    proc = publish(tmp_path, hub, *args)  # converted again, to the same bytes
    assert proc.returncode == 0, proc.stderr
    assert results(proc)[repo]["status"] == "unchanged"
    assert sum(1 for m, p in hub.requests if "/commit/" in p) == commits


def test_default_calibration_is_named_on_the_card_and_a_plain_run_then_replaces_it(tmp_path, hub, src):
    """The shipped sample by name; publishing the same repo without the options uploads the plain variant (the
    cache's) in its place, with neither the KV-cache scales nor their description."""
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "tensor", "--kv-cache", "fp8",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    repo = "tester/tiny-FP8-Tensor"
    provenance = json.loads(hub.file(repo, "fp8kit.json"))
    assert provenance["calibration"]["file"] == "sample.txt (shipped with fp8kit)"
    assert "calibrated on sample.txt (shipped with fp8kit)" in ModelCard(hub.file(repo, "README.md").decode()).text

    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "tensor", "--json")
    assert proc.returncode == 0, proc.stderr
    assert results(proc)[repo]["status"] == "uploaded"
    assert json.loads(hub.file(repo, "config.json"))["quantization_config"]["kv_cache_scheme"] is None
    assert "kv_cache" not in json.loads(hub.file(repo, "fp8kit.json"))
    assert "KV cache" not in ModelCard(hub.file(repo, "README.md").decode()).text


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.mark.parametrize("extra, needle", [
    (["--kv-cache", "fp8", "--format", "fp8", "--scheme", "block"], "--kv-cache fp8 is written in the "
                                                                    "compressed-tensors format only"),
    (["--lm-head", "--format", "fp8", "--scheme", "block"], "--lm-head is written in the compressed-tensors format"),
    (["--calibration", "{calib}", "--scheme", "dynamic"], "--calibration is for --scheme tensor-static or "
                                                          "--kv-cache fp8"),
    (["--kv-cache", "fp8", "--calibration", "{missing}", "--scheme", "dynamic"], "missing.txt: cannot read the "
                                                                                 "calibration text"),
    (["--ignore", "(", "--scheme", "dynamic"], "--ignore '(': not a regular expression"),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, src, isolated, extra, needle):
    extra = [a.format(calib=tmp_path / "calib.txt", missing=tmp_path / "missing.txt") for a in extra]
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--org", "me", "--dry-run",
                                       "--staging", str(tmp_path / "staging"), *extra])
    line = one_line_error(result)
    assert needle in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


@pytest.mark.parametrize("top, entry, needle", [
    ("", 'kv_cache = "fp16"', "[[model]] number 2: 'kv_cache' must be \"fp8\""),
    ("", "lm_head = 1", "[[model]] number 2: 'lm_head' must be true or false"),
    ("", 'ignore = "mlp"', "[[model]] number 2: 'ignore' must be a list of regular expressions"),
    ("", 'ignore = ["("]', "[[model]] number 2: --ignore '(': not a regular expression"),
    ("", 'calibration = ""', "[[model]] number 2: 'calibration' must be a non-empty string"),
    ("", 'calibration = "{missing}"', "[[model]] number 2: --calibration is for"),
    ("", 'kv_cache = "fp8"\ncalibration = "{missing}"', "missing.txt: cannot read the calibration text"),
    ('kv_cache = "fp8"\n', 'format = "fp8"\nschemes = ["block"]',
     "[[model]] number 2: --kv-cache fp8 is written in the compressed-tensors format only"),
])
def test_plan_options_are_checked_before_any_work(tmp_path, src, isolated, top, entry, needle):
    plan = tmp_path / "plan.toml"
    entry = entry.format(missing=tmp_path / "missing.txt")
    second = f'[[model]]\nsrc = "{src}"\nbase_model = "org/second"\n{entry}\n'
    if "schemes" not in entry:
        second += 'schemes = ["dynamic"]\n'
    plan.write_text(top + GOOD.format(src=src) + second)
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging")])
    line = one_line_error(result)
    assert line.startswith(f"error: {plan}: ") and needle in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_plan_entries_differing_only_in_options_into_one_repo_are_refused(tmp_path, src, isolated):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src) + GOOD.format(src=src) + 'kv_cache = "fp8"\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "compressed-tensors) and number 2" in result.stderr, result.stderr
    assert "compressed-tensors, --kv-cache fp8) both publish dynamic to me/tiny-FP8-Dynamic" in result.stderr


def test_plan_and_command_line_setting_one_option_is_refused(tmp_path, src, isolated):
    plan = tmp_path / "plan.toml"
    plan.write_text("lm_head = true\n" + GOOD.format(src=src))
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--lm-head"])
    assert result.exit_code == 2 and "'lm_head'" in result.stderr and "--lm-head" in result.stderr, result.stderr


def test_command_line_options_are_the_plan_defaults_and_an_entry_overrides_them(tmp_path, src, isolated):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src) + GOOD.format(src=src).replace("org/tiny", "org/other") + "lm_head = false\n")
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--lm-head",
                                       "--staging", str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 0, result.stderr
    staged = {r["repo_id"]: r["staging"] for r in json.loads(result.stdout)}
    first = json.loads((tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "fp8kit.json").read_text())
    second = json.loads((tmp_path / "staging" / "me--other-FP8-Dynamic" / "fp8kit.json").read_text())
    assert set(staged) == {"me/tiny-FP8-Dynamic", "me/other-FP8-Dynamic"}
    assert first["lm_head"] is True and "lm_head" not in second
    assert not list((tmp_path / "staging").glob(".*conversion*"))  # the run's own conversions are removed


def test_a_variant_that_cannot_take_an_option_fails_alone_and_leaves_nothing(tmp_path, isolated):
    """Qwen3 here ties lm_head to the embeddings: --lm-head fails its conversion (a row of its own, exit 1), and
    nothing of the run's conversion is left in the staging folder."""
    import torch

    from fp8kit.models import build_checkpoint

    tied = build_checkpoint(tmp_path / "qwen3", "qwen3", torch.bfloat16, seed=0)
    result = CliRunner().invoke(main, ["publish", str(tied), "--base-model", "org/q", "--scheme", "dynamic",
                                       "--lm-head", "--org", "me", "--dry-run", "--staging", str(tmp_path / "staging"),
                                       "--json"])
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)
    assert row["status"] == "failed" and "tied" in row["error"] and "--lm-head" in row["error"], row
    assert not (tmp_path / "staging").exists()  # convert() removes the folders it made
    assert not (tmp_path / "fp8cache").exists()


def test_an_entry_turns_plan_defaults_off_and_a_default_calibration_reaches_only_calibrating_entries(
        tmp_path, src, isolated):
    """Top-level kv_cache and calibration: the fp8-format entry opts out with kv_cache = false (it cannot hold the
    scales), and neither it nor an entry without kv_cache is refused for the inherited calibration."""
    calib = tmp_path / "calib.txt"
    calib.write_bytes(TEXT.replace(". ", ".\r\n").encode())  # CRLF: recorded as the file's own sha256
    plan = tmp_path / "plan.toml"
    plan.write_text(f'kv_cache = "fp8"\ncalibration = "{calib}"\n' + GOOD.format(src=src)
                    + GOOD.format(src=src).replace("org/tiny", "org/blk").replace('"dynamic"', '"block"')
                    + 'format = "fp8"\nkv_cache = false\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 0, result.stderr
    assert {r["status"] for r in json.loads(result.stdout)} == {"dry-run"}
    first = json.loads((tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "fp8kit.json").read_text())
    second = json.loads((tmp_path / "staging" / "me--blk-FP8-Block" / "fp8kit.json").read_text())
    assert first["calibration"]["sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest()
    assert "kv_cache" not in second and "calibration" not in second and second["format"] == "fp8"


def test_an_ignore_pattern_that_matches_nothing_fails_the_variant(tmp_path, src, isolated):
    """fp8-convert warns; publish would put the pattern on the card as if it kept layers. The --staging folder the
    run's conversion created is not left behind."""
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--ignore", "down_prj", "--org", "me", "--dry-run", "--staging",
                                       str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)
    assert row["status"] == "failed" and "--ignore 'down_prj' matched no weight" in row["error"], row
    assert not (tmp_path / "staging").exists()


def test_text_report_says_why_layers_were_kept(tmp_path, src, isolated):
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--ignore", r"layers\.1\.mlp\.down_proj", "--org", "me", "--dry-run",
                                       "--staging", str(tmp_path / "staging")])
    assert result.exit_code == 0, result.output
    assert "1 Linear layers kept in the source precision (--ignore, or the scheme cannot take their shapes), e.g. " \
           "model.layers.1.mlp.down_proj" in result.stdout


def test_validation_sample_fits_the_model_and_a_foreign_tokenizer_is_one_line(tmp_path, isolated):
    """The sample was cut at 512 tokens whatever max_position_embeddings said, and a tokenizer whose ids run past
    the model's vocabulary failed the variant with a bare IndexError. A tokenizer that cannot give the sample is
    named before any conversion (it was found only when validating, after converting the whole model)."""
    import torch

    from fp8kit.hub.validate import sample_ids
    from fp8kit.models import build_checkpoint

    short = build_checkpoint(tmp_path / "short", "llama", torch.bfloat16, seed=1, max_position_embeddings=128)
    add_tokenizer(short, TEXT, vocab_size=300)
    assert sample_ids(short)[0].shape[1] == 128
    from fp8kit.hub.validate import SAMPLE

    small = build_checkpoint(tmp_path / "small", "llama", torch.bfloat16, seed=1, vocab_size=300)
    add_tokenizer(small, SAMPLE.read_text() * 3, vocab_size=512)  # trained on the sample: ids up to 511
    staging = tmp_path / "staging"
    result = CliRunner().invoke(main, ["publish", str(small), "--base-model", "org/small", "--scheme", "dynamic",
                                       "--org", "me", "--dry-run", "--staging", str(staging), "--json"])
    assert "past the model's vocab_size 300" in one_line_error(result)
    assert not (tmp_path / "fp8cache").exists() and not staging.exists()  # nothing converted or staged
    # a tokenizer.json that is no JSON: a bare JSONDecodeError that named no file
    (short / "tokenizer.json").write_text("{'not': json}")
    result = CliRunner().invoke(main, ["publish", str(short), "--base-model", "org/short", "--scheme", "dynamic",
                                       "--scheme", "block", "--org", "me", "--dry-run", "--staging", str(staging),
                                       "--json"])
    line = one_line_error(result)
    assert line.startswith(f"error: {short}: its tokenizer does not load ("), line
    assert "fix the tokenizer files (tokenizer.json, tokenizer_config.json)" in line, line
    assert not (tmp_path / "fp8cache").exists() and not staging.exists()
    # in a plan, the entry's variants fail under their repos and the next entry is published
    plan = tmp_path / "plan.toml"
    plan.write_text(f'org = "me"\n[[model]]\nsrc = "{short}"\nbase_model = "org/short"\nschemes = ["dynamic", '
                    f'"block"]\n[[model]]\nsrc = "{short.parent / "ok"}"\nbase_model = "org/ok"\n'
                    f'schemes = ["dynamic"]\n')
    build_checkpoint(tmp_path / "ok", "llama", torch.bfloat16, seed=1)
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--staging", str(staging),
                                       "--json"])
    rows = {r["repo_id"]: r for r in json.loads(result.stdout)}
    assert [rows[f"me/short-FP8-{s}"]["status"] for s in ("Dynamic", "Block")] == ["failed", "failed"], rows
    assert "its tokenizer does not load" in rows["me/short-FP8-Dynamic"]["error"]
    assert rows["me/ok-FP8-Dynamic"]["status"] == "dry-run", rows


def test_tensor_static_without_a_tokenizer_fails_before_the_cache_is_touched(tmp_path, hub, llama_dir):
    """Validation takes random ids where a source has no tokenizer, so the doomed calibration was found only inside
    the registry cache's conversion, after its lock file and source record were written there."""
    src = tmp_path / "tiny-llama"
    shutil.copytree(llama_dir, src)
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "tensor-static", "--dry-run", "--org",
                   "me", "--json")
    row = results(proc)["me/tiny-FP8-Tensor-Static"]
    assert proc.returncode == 1 and row["status"] == "failed", proc.stdout
    assert "--scheme tensor-static needs the model's tokenizer to calibrate" in row["error"], row
    cache = tmp_path / "fp8cache"
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()], list(cache.rglob("*"))


def test_tensor_static_is_published_with_its_calibration_beside_a_plain_variant(tmp_path, hub, src):
    """tensor-static (vLLM's fastest FP8 path) could be converted but not published. It always calibrates: --calibration
    is its text (not the plain variant's, converted from the cache beside it), recorded on the card and in
    fp8kit.json, and it registers as a variant that answers no other scheme (the GRPO runtime refuses static
    activation scales)."""
    pytest.importorskip("llmcompressor")
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--scheme", "tensor-static", "--calibration",
            tmp_path / "calib.txt", "--json"]
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    out = results(proc)
    repo = "tester/tiny-FP8-Tensor-Static"
    assert out[repo]["status"] == "uploaded" and out[repo]["metrics"]["kl"] < 5e-3, out
    assert out["tester/tiny-FP8-Dynamic"]["status"] == "uploaded", out

    qc = json.loads(hub.file(repo, "config.json"))["quantization_config"]
    activations = qc["config_groups"]["group_0"]["input_activations"]
    assert activations["dynamic"] is False and activations["strategy"] == "tensor", activations
    index = json.loads(hub.file(repo, "model.safetensors.index.json"))["weight_map"] \
        if "model.safetensors.index.json" in hub.repos[repo]["files"] else None
    names = sorted(set(index.values())) if index else ["model.safetensors"]
    weights = {}
    for shard in names:
        weights.update(tensors(hub.file(repo, shard), tmp_path))
    assert weights["model.layers.0.mlp.down_proj.input_scale"].numel() == 1
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype.itemsize == 1

    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    assert json.loads(hub.file(repo, "fp8kit.json"))["calibration"] == {"file": "calib.txt", "sha256": digest}
    assert "calibration" not in json.loads(hub.file("tester/tiny-FP8-Dynamic", "fp8kit.json"))
    card = ModelCard(hub.file(repo, "README.md").decode()).text
    assert "**FP8 per-tensor, static activations**" in card and "calibrated on calib.txt" in card
    assert "--scheme tensor-static --org tester --repo-template '{org}/{name}-FP8-{Scheme}' --calibration calib.txt" \
        in card, card
    assert "--calibration" not in ModelCard(hub.file("tester/tiny-FP8-Dynamic", "README.md").decode()).text
    assert not list((tmp_path / "fp8cache").glob("*/*/tensor-static-*"))  # converted for the run, not cached
    assert not list((tmp_path / "tmp").iterdir())

    overlay = (tmp_path / "overlay.toml").read_text()
    assert 'repo_id = "tester/tiny-FP8-Tensor-Static"' in overlay and 'serves = ["tensor-static"]' in overlay
    env = {"FP8KIT_REGISTRY": str(tmp_path / "overlay.toml")}
    listed = CliRunner().invoke(main, ["registry", "list", "--json"], env=env)
    assert {v["repo_id"]: v["scheme"] for v in json.loads(listed.stdout)}[repo] == "tensor-static"
    resolved = CliRunner().invoke(main, ["resolve", "org/tiny", "--scheme", "tensor", "--json"], env=env)
    assert json.loads(resolved.stdout)["repo_id"] is None  # a static upload does not answer tensor

    commits = sum(1 for m, p in hub.requests if "/commit/" in p)
    proc = publish(tmp_path, hub, *args)  # calibrated again, to the same bytes
    assert proc.returncode == 0, proc.stderr
    assert {r["status"] for r in results(proc).values()} == {"unchanged"}
    assert sum(1 for m, p in hub.requests if "/commit/" in p) == commits


def test_tensor_static_on_the_shipped_sample_is_the_cache_s_conversion(tmp_path, hub, src):
    """Without --calibration, tensor-static is what `ensure(name, "tensor-static")` makes: converted into the registry's
    cache once, so a re-run (an upload that failed, say) does not calibrate again."""
    pytest.importorskip("llmcompressor")
    args = [src, "--base-model", "org/tiny", "--scheme", "tensor-static", "--json"]
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    repo = "tester/tiny-FP8-Tensor-Static"
    assert results(proc)[repo]["status"] == "uploaded"
    assert json.loads(hub.file(repo, "fp8kit.json"))["calibration"]["file"] == "sample.txt (shipped with fp8kit)"
    (entry,) = [p for p in (tmp_path / "fp8cache").glob("*/*/tensor-static-compressed-tensors-*") if p.is_dir()]
    marker = (entry / "fp8kit-entry.json").stat().st_mtime_ns
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    assert results(proc)[repo]["status"] == "unchanged"
    assert (entry / "fp8kit-entry.json").stat().st_mtime_ns == marker  # not converted again
    assert len((tmp_path / "fp8cache" / "conversions.log").read_text().splitlines()) == 1


def test_a_tokenizer_that_loads_but_cannot_encode_is_one_line(tmp_path, src, monkeypatch):
    """A tokenizer that loads and then raises on the sample (a broken normalizer, say) was a bare exception."""
    import transformers

    from fp8kit.errors import Fp8kitError
    from fp8kit.hub.validate import sample_ids

    def broken(text, **kwargs):
        raise RuntimeError("normalizer failed")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kwargs: broken)
    with pytest.raises(Fp8kitError, match=f"^{src}: its tokenizer loads but fails on the validation sample "
                                          r"\(RuntimeError: normalizer failed\)"):
        sample_ids(src)


def test_a_source_without_config_fails_its_variant_not_the_run(tmp_path, src, isolated):
    """What sample_ids cannot read before converting (no config.json) is left to the conversion, which names it in
    the variant's row; it was a FileNotFoundError traceback."""
    (src / "config.json").unlink()
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--org", "me", "--dry-run", "--staging", str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)
    assert row["status"] == "failed" and row["error"].startswith(f"{src / 'config.json'}: missing"), row


def test_tensor_static_is_compressed_tensors_only(tmp_path, src, isolated):
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--org", "me", "--dry-run",
                                       "--format", "fp8", "--scheme", "block", "--scheme", "tensor-static"])
    assert "tensor-static is written in the compressed-tensors format only" in one_line_error(result)


def test_a_source_readme_without_a_metadata_header_gives_no_terms_and_no_hub_warning(tmp_path, caplog):
    """huggingface_hub's ModelCard logged "Repo card metadata block was not found" on every publish of such a source."""
    import logging

    from fp8kit.hub.card import source_terms

    (tmp_path / "README.md").write_text("# A model\n\nNo front matter here.\n")
    with caplog.at_level(logging.INFO, logger="huggingface_hub"):
        assert source_terms(tmp_path) == {}
        (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A model\n")
        assert source_terms(tmp_path) == {"license": "apache-2.0"}
    assert caplog.records == []
