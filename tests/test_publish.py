"""fp8kit publish end to end against a local fake Hub (tests/fake_hub.py), driven by the real
huggingface_hub client through HF_ENDPOINT."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard

from fake_hub import TOKEN, FakeHub
from fp8kit.converter.source import CHAT_TEMPLATES_DIR as CHAT_TEMPLATES

SOURCE_CARD = """---
license: llama3.2
extra_gated_prompt: You agree to the Llama 3.2 Community License.
language:
- en
---
# Tiny Llama
"""


@pytest.fixture
def hub(tmp_path):
    server = FakeHub(tmp_path / "hub-store")
    yield server
    server.close()


@pytest.fixture
def src(tmp_path, llama_dir):
    path = tmp_path / "tiny-llama"
    shutil.copytree(llama_dir, path)
    (path / "README.md").write_text(SOURCE_CARD)
    return path


def publish(tmp_path, hub, *args, token=TOKEN):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", FP8KIT_CACHE=str(tmp_path / "fp8cache"),
               FP8KIT_REGISTRY=str(tmp_path / "overlay.toml"), FP8KIT_HUB_RETRY_SECONDS="0")
    if not env.get("TMPDIR", "").startswith(str(tmp_path)):  # a dry run keeps its staging folder: not in /tmp
        (tmp_path / "tmp").mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp_path / "tmp")
    if token:
        env["HF_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-m", "fp8kit.cli", "publish", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert TOKEN not in proc.stdout + proc.stderr
    return proc


def results(proc):
    return {r["repo_id"]: r for r in json.loads(proc.stdout)}


def test_publish_two_schemes_then_rerun_uploads_nothing(tmp_path, hub, src):
    args = [src, "--base-model", "meta-llama/Llama-3.2-1B", "--scheme", "dynamic", "--scheme", "block", "--json"]
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    out = results(proc)
    assert {r["status"] for r in out.values()} == {"uploaded"}
    for repo_id, scheme in [("tester/Llama-3.2-1B-FP8-Dynamic", "dynamic"), ("tester/Llama-3.2-1B-FP8-Block", "block")]:
        staged = tmp_path / "fp8cache"
        entry = next(p for p in staged.glob(f"local--tiny-llama-*/*/{scheme}-compressed-tensors-*") if p.is_dir())
        assert hub.file(repo_id, "model.safetensors") == (entry / "model.safetensors").read_bytes()
        assert json.loads(hub.file(repo_id, "config.json"))["quantization_config"]["quant_method"] == "compressed-tensors"
        card = ModelCard(hub.file(repo_id, "README.md").decode())
        assert card.data.base_model == "meta-llama/Llama-3.2-1B"
        assert card.data.base_model_relation == "quantized"
        assert card.data.license == "llama3.2" and "Llama 3.2" in card.data.extra_gated_prompt
        assert set(card.data.tags) >= {"fp8", "compressed-tensors", "vllm", scheme}
        assert "random token ids" in card.text and f"vllm serve {repo_id}" in card.text
        assert out[repo_id]["metrics"]["kl"] < 5e-3
        assert json.loads(hub.file(repo_id, "fp8kit.json"))["scheme"] == scheme
    overlay = (tmp_path / "overlay.toml").read_text()
    assert 'repo_id = "tester/Llama-3.2-1B-FP8-Dynamic"' in overlay
    assert TOKEN not in overlay

    commits = sum(1 for m, p in hub.requests if "/commit/" in p)
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    assert {r["status"] for r in results(proc).values()} == {"unchanged"}
    assert sum(1 for m, p in hub.requests if "/commit/" in p) == commits
    assert overlay == (tmp_path / "overlay.toml").read_text()  # registered once


def test_dry_run_contacts_no_server_and_needs_no_token(tmp_path, hub, src):
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "tensor", "--dry-run", "--org", "me",
                   "--staging", tmp_path / "staging", "--scheme", "tensor", token=None)
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []
    assert proc.stdout.count("me/tiny-FP8-Tensor") == 1  # a scheme given twice is one variant
    folder = tmp_path / "staging" / "me--tiny-FP8-Tensor"
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md", "config.json", "fp8kit.json", "generation_config.json", "model.safetensors"]
    assert "me/tiny-FP8-Tensor" in proc.stdout and "model.safetensors" in proc.stdout
    assert not (tmp_path / "overlay.toml").exists()


def test_no_token_and_bad_token_fail_before_converting(tmp_path, hub, src):
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", token=None)
    assert proc.returncode == 1 and "no Hugging Face token" in proc.stderr
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", token="hf_wrong")
    assert proc.returncode == 1 and "401" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "fp8cache").exists()


def test_server_errors_retry_and_rerun_resumes(tmp_path, hub, src):
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json"]
    hub.faults["/commit/"] = [500]  # one 500 midway: retried, then uploaded
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    assert results(proc)["tester/tiny-FP8-Dynamic"]["status"] == "uploaded"

    args = [src, "--base-model", "org/tiny", "--scheme", "block", "--json"]
    hub.faults["/commit/"] = [429, 503, 500]  # every attempt fails: reported, nothing registered
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 1
    failed = results(proc)["tester/tiny-FP8-Block"]
    assert failed["status"] == "failed" and "500" in failed["error"] and "re-run" in failed["error"]
    assert "tiny-FP8-Block" not in (tmp_path / "overlay.toml").read_text()
    puts = sum(1 for m, p in hub.requests if m == "PUT")
    proc = publish(tmp_path, hub, *args)  # the re-run resumes: the weights were already uploaded
    assert proc.returncode == 0, proc.stderr
    assert results(proc)["tester/tiny-FP8-Block"]["status"] == "uploaded"
    assert sum(1 for m, p in hub.requests if m == "PUT") == puts
    assert "tiny-FP8-Block" in (tmp_path / "overlay.toml").read_text()


def test_foreign_repo_needs_force(tmp_path, hub, src):
    hub.add_repo("tester/tiny-FP8-Dynamic", {"README.md": b"someone else's model"})
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json"]
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 1 and "--force" in results(proc)["tester/tiny-FP8-Dynamic"]["error"]
    assert hub.file("tester/tiny-FP8-Dynamic", "README.md") == b"someone else's model"
    proc = publish(tmp_path, hub, *args, "--force")
    assert proc.returncode == 0 and b"fp8kit" in hub.file("tester/tiny-FP8-Dynamic", "README.md")


def test_an_fp8kit_repo_of_another_base_model_needs_force(tmp_path, hub, src):
    """Published from another machine (whose overlay this one never saw), `tester/Foo-FP8-Dynamic` of org-a/Foo
    was replaced by org-b/Foo's weights: the repo's fp8kit.json names its base, and it is read first."""
    hub.add_repo("tester/Foo-FP8-Dynamic", {"fp8kit.json": json.dumps({"tool": "fp8kit", "base_model": "org-a/Foo",
                                                                      "scheme": "dynamic"}).encode(),
                                            "model.safetensors": b"org-a's weights"})
    args = [src, "--base-model", "org-b/Foo", "--scheme", "dynamic", "--json"]
    proc = publish(tmp_path, hub, *args)
    error = results(proc)["tester/Foo-FP8-Dynamic"]["error"]
    assert proc.returncode == 1 and "variant of org-a/Foo" in error and "not of org-b/Foo" in error, error
    assert hub.file("tester/Foo-FP8-Dynamic", "model.safetensors") == b"org-a's weights"
    assert not (tmp_path / "overlay.toml").exists() or "Foo" not in (tmp_path / "overlay.toml").read_text()
    proc = publish(tmp_path, hub, *args, "--force")
    assert proc.returncode == 0 and hub.file("tester/Foo-FP8-Dynamic", "model.safetensors") != b"org-a's weights"
    # the same base, spelled in another case: an update, no --force needed
    hub.add_repo("tester/Bar-FP8-Dynamic", {"fp8kit.json": json.dumps({"base_model": "ORG-A/bar"}).encode()})
    proc = publish(tmp_path, hub, src, "--base-model", "org-a/Bar", "--scheme", "dynamic", "--json")
    assert proc.returncode == 0 and results(proc)["tester/Bar-FP8-Dynamic"]["status"] == "uploaded", proc.stdout
    # provenance that does not parse tells nothing about the weights: as a repo without one, --force to replace
    for i, (text, says) in enumerate([(b"{not json", "is not readable JSON"), (b"{}", "names no base model"),
                                      (b"[]", "names no base model"), (b'{"base_model": null}', "names no base model")]):
        repo = f"tester/Baz{i}-FP8-Dynamic"
        hub.add_repo(repo, {"fp8kit.json": text, "model.safetensors": b"someone's weights"})
        args = [src, "--base-model", f"org-a/Baz{i}", "--scheme", "dynamic", "--json"]
        proc = publish(tmp_path, hub, *args)
        error = results(proc)[repo]["error"]
        assert proc.returncode == 1 and f"fp8kit.json {says}" in error and "--force" in error, error
        assert hub.file(repo, "model.safetensors") == b"someone's weights"
    assert publish(tmp_path, hub, *args, "--force").returncode == 0


def test_an_fp8kit_repo_of_another_scheme_or_format_needs_force(tmp_path, hub, src):
    """A --repo-template without {scheme}, used on another machine for block in the fp8 format: publishing dynamic
    there replaced the block weights that machine's overlay (and its users' registries) list as block."""
    hub.add_repo("tester/tiny-FP8", {"fp8kit.json": json.dumps({"tool": "fp8kit", "base_model": "org/tiny",
                                                                "scheme": "block", "format": "fp8"}).encode(),
                                     "model.safetensors": b"block weights"})
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--repo-template", "{org}/{name}-FP8", "--json"]
    proc = publish(tmp_path, hub, *args)
    error = results(proc)["tester/tiny-FP8"]["error"]
    assert proc.returncode == 1, proc.stderr
    assert ("holds fp8kit's variant of org/tiny with scheme block, format fp8 (its fp8kit.json), not scheme dynamic, "
            "format compressed-tensors") in error and "--force" in error, error
    assert hub.file("tester/tiny-FP8", "model.safetensors") == b"block weights"
    proc = publish(tmp_path, hub, *args, "--force")
    assert proc.returncode == 0 and hub.file("tester/tiny-FP8", "model.safetensors") != b"block weights"
    staged = json.loads(hub.file("tester/tiny-FP8", "fp8kit.json"))
    assert (staged["scheme"], staged["format"]) == ("dynamic", "compressed-tensors")
    proc = publish(tmp_path, hub, *args)  # the same variant again: an update, no --force needed
    assert proc.returncode == 0 and results(proc)["tester/tiny-FP8"]["status"] == "unchanged", proc.stdout


def test_max_kl_rejects_and_plan_goes_on_past_failures(tmp_path, hub, src):
    plan = tmp_path / "plan.toml"
    plan.write_text(f'''
max_kl = 1e-9
[[model]]
src = "{src}"
base_model = "org/tiny"
schemes = ["dynamic"]

[[model]]
src = "{tmp_path / 'missing'}"
base_model = "org/missing"
schemes = ["block"]

[[model]]
src = "org/not-on-the-hub"
schemes = ["tensor", "block"]
''')
    proc = publish(tmp_path, hub, "--plan", plan, "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert [r["status"] for r in out] == ["rejected", "failed", "failed", "failed"]
    assert "--max-kl" in out[0]["error"] and "missing" in out[1]["error"] and "not found" in out[2]["error"]
    # failed rows name the repos they were to publish, not their SRC (the token's user is their org)
    assert [r["repo_id"] for r in out[1:]] == ["tester/missing-FP8-Block", "tester/not-on-the-hub-FP8-Tensor",
                                               "tester/not-on-the-hub-FP8-Block"]
    assert not any("/commit/" in p for m, p in hub.requests)


def test_plan_entries_sharing_a_repo_through_the_token_user_are_refused(tmp_path, hub, src):
    """An entry without org publishes under the token's user; another naming that user as its org was compared with
    the placeholder "{token user}", so both uploaded into one repo, the second replacing the first's weights."""
    finetune = tmp_path / "finetune"
    shutil.copytree(src, finetune)
    plan = tmp_path / "plan.toml"
    plan.write_text(f'''
[[model]]
src = "{src}"
base_model = "org/tiny"
schemes = ["dynamic"]

[[model]]
src = "{finetune}"
base_model = "org/tiny"
org = "tester"
schemes = ["dynamic"]
''')
    proc = publish(tmp_path, hub, "--plan", plan)
    assert proc.returncode == 2, proc.stderr
    assert "both publish dynamic to tester/tiny-FP8-Dynamic" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not any("/commit/" in p for m, p in hub.requests)


def test_create_pr_opens_a_pull_request_and_leaves_main(tmp_path, hub, src):
    hub.add_repo("tester/tiny-FP8-Dynamic", {"fp8kit.json": json.dumps({"base_model": "org/tiny"}).encode()})
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--create-pr", "--json")
    assert proc.returncode == 0, proc.stderr
    result = results(proc)["tester/tiny-FP8-Dynamic"]
    assert result["status"] == "uploaded" and result["url"].endswith("/tester/tiny-FP8-Dynamic/discussions/1")
    assert "model.safetensors" not in hub.repos["tester/tiny-FP8-Dynamic"]["files"]  # main untouched
    assert "model.safetensors" in hub.repos["tester/tiny-FP8-Dynamic@pr1"]["files"]
    assert not (tmp_path / "overlay.toml").exists()  # registered once the PR is merged and published again


def test_force_replaces_stale_files(tmp_path, hub, src):
    """The repo then holds what was staged, nothing else: an old shard or index would be loaded with the new weights,
    and the card describes only what fp8kit uploaded."""
    hub.add_repo("tester/tiny-FP8-Dynamic", {"model-00001-of-00002.safetensors": b"old shard",
                                             "model.safetensors.index.json": b"{}", "notes.txt": b"old notes",
                                             ".gitattributes": b"*.bin filter=lfs\n"})
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    staged = {"README.md", "config.json", "fp8kit.json", "generation_config.json", "model.safetensors"}
    assert set(hub.repos["tester/tiny-FP8-Dynamic"]["files"]) == staged | {".gitattributes"}
    assert hub.file("tester/tiny-FP8-Dynamic", ".gitattributes") == b"*.bin filter=lfs\n"  # the Hub's own: kept


def test_republishing_removes_files_the_source_no_longer_has(tmp_path, hub, src):
    """A chat template dropped from the source stayed on the Hub (with the new weights), and a re-publish that
    changed nothing else reported "unchanged"."""
    (src / "chat_template.jinja").write_text("{{ old template }}")
    (src / CHAT_TEMPLATES).mkdir()
    (src / CHAT_TEMPLATES / "tool_use.jinja").write_text("{{ old tools }}")
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json"]
    assert publish(tmp_path, hub, *args).returncode == 0
    files = hub.repos["tester/tiny-FP8-Dynamic"]["files"]
    assert "chat_template.jinja" in files and f"{CHAT_TEMPLATES}/tool_use.jinja" in files
    (src / "chat_template.jinja").unlink()
    shutil.rmtree(src / CHAT_TEMPLATES)
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stderr
    assert results(proc)["tester/tiny-FP8-Dynamic"]["status"] == "uploaded"
    files = hub.repos["tester/tiny-FP8-Dynamic"]["files"]
    assert "chat_template.jinja" not in files and f"{CHAT_TEMPLATES}/tool_use.jinja" not in files
    assert {".gitattributes", "model.safetensors", "README.md"} <= set(files)
    proc = publish(tmp_path, hub, *args)  # now the repo is what is staged
    assert proc.returncode == 0 and results(proc)["tester/tiny-FP8-Dynamic"]["status"] == "unchanged", proc.stderr


def test_publishing_into_an_inline_overlay_keeps_every_registry_command_working(tmp_path, hub, src):
    """With `variant = [...]` (which README accepts), publish appended a [[variant]] table: invalid TOML, so publish
    succeeded and every registry command then failed."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('variant = [\n  { repo_id = "me/Qwen3-8B-FP8-Dynamic", family = "qwen3", scheme = "dynamic", '
                       'format = "compressed-tensors", serves = ["dynamic"], base = ["Qwen/Qwen3-8B"] },\n]\n')
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json")
    assert proc.returncode == 0 and results(proc)["tester/tiny-FP8-Dynamic"]["status"] == "uploaded", proc.stderr
    env = {**os.environ, "FP8KIT_REGISTRY": str(overlay), "FP8KIT_CACHE": str(tmp_path / "fp8cache")}
    listing = subprocess.run([sys.executable, "-m", "fp8kit.cli", "registry", "list", "--json"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    mine = [v["repo_id"] for v in json.loads(listing.stdout) if v["source"] == "overlay"]
    assert mine == ["me/Qwen3-8B-FP8-Dynamic", "tester/tiny-FP8-Dynamic"]
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "block", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "tester/tiny-FP8-Block" in overlay.read_text() and "[[variant]]" not in overlay.read_text()


def test_bad_base_model_is_refused_before_any_work(tmp_path, hub, src):
    proc = publish(tmp_path, hub, src, "--base-model", "tiny", "--scheme", "dynamic")
    assert proc.returncode == 1 and "--base-model 'tiny'" in proc.stderr
    assert not (tmp_path / "fp8cache").exists() and hub.requests == []


def test_dry_runs_reuse_the_cache_and_keep_it_intact(tmp_path, src, monkeypatch):
    from fp8kit.hub import publish as publish_api

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    for _ in range(2):
        [result] = publish_api(str(src), ["dynamic"], base_model="org/tiny", org="me", dry_run=True,
                               staging=tmp_path / "staging")
        assert result.status == "dry-run"
    assert len((tmp_path / "fp8cache" / "conversions.log").read_text().splitlines()) == 1
    entry = next(p for p in (tmp_path / "fp8cache").glob("*/*/dynamic-*") if p.is_dir())
    assert (entry / "README.md").read_text() == SOURCE_CARD  # the card was not written through a hard link
    card = (tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "README.md").read_text()
    assert f"fp8kit publish {src} --base-model org/tiny --scheme dynamic" in card  # not the host's argv


def test_each_card_names_only_its_own_scheme(tmp_path, src, monkeypatch):
    from fp8kit.hub import publish as publish_api

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    results = publish_api(str(src), ["dynamic", "tensor"], base_model="org/tiny", org="me", dry_run=True,
                          staging=tmp_path / "staging")
    assert [r.status for r in results] == ["dry-run", "dry-run"]
    for variant, scheme, other in (("Dynamic", "dynamic", "tensor"), ("Tensor", "tensor", "dynamic")):
        made = (tmp_path / "staging" / f"me--tiny-FP8-{variant}" / "README.md").read_text().split("## How it was made")[1]
        assert f"--base-model org/tiny --scheme {scheme} --org me --repo-template" in made
        assert f"--scheme {other}" not in made


def test_validation_failure_is_one_line_and_the_plan_goes_on(tmp_path, hub, src):
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "notamodel"
    (broken / "config.json").write_text(json.dumps(config))
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[model]]\nsrc = "{broken}"\nbase_model = "org/broken"\nschemes = ["dynamic"]\n'
                    f'[[model]]\nsrc = "{src}"\nbase_model = "org/tiny"\nschemes = ["dynamic"]\n')
    proc = publish(tmp_path, hub, "--plan", plan, "--json", "--dry-run", "--org", "me", token=None)
    out = json.loads(proc.stdout)
    assert [r["status"] for r in out] == ["failed", "dry-run"]
    assert "notamodel" in out[0]["error"] and "\n" not in out[0]["error"]
    assert "Traceback" not in proc.stderr


def test_bad_repo_template_is_one_line(tmp_path, hub, src):
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--dry-run", "--org", "me",
                   "--repo-template", "{org}/{model}-fp8", token=None)
    assert proc.returncode == 1 and "--repo-template" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_named_chat_templates_reach_the_staged_variant(tmp_path, src, monkeypatch):
    """Staging linked the conversion's top-level files only: a subfolder of chat templates would not be uploaded."""
    from fp8kit.hub import publish as publish_api

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    [result] = publish_api(str(src), ["dynamic"], base_model="org/tiny", org="me", dry_run=True,
                           staging=tmp_path / "staging")
    staged = tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "additional_chat_templates" / "tool_use.jinja"
    assert staged.read_text() == "{{ tools }}" and "additional_chat_templates/tool_use.jinja" in result.files


def test_card_counts_each_kept_layer_once_where_transformers_renames_it(tmp_path):
    """Gemma 3 multimodal: the ignore list names a kept module by its checkpoint name and by the name transformers
    loads it under; the card's "N more Linear layers" counted both."""
    import torch

    from fp8kit import convert
    from fp8kit.hub.card import kept_layers
    from fp8kit.models import build_checkpoint

    src = build_checkpoint(tmp_path / "src", "gemma3_mm", torch.bfloat16, seed=3)
    out = tmp_path / "out"
    convert(src, out, scheme="dynamic", ignore=[r"layers\.0\.mlp\."])
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.language_model.layers.0.mlp.up_proj" in ignore
    assert kept_layers(out) == [f"language_model.model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]


def test_block_in_the_fp8_format_is_published_registered_and_kept_apart_from_compressed_tensors(tmp_path, hub, src):
    """--format fp8: the DeepSeek-V3 / Qwen3-*-FP8 layout SGLang and vLLM read (`weight_scale_inv`), converted
    through the cache, validated, carded and registered with its format; the same repo in compressed-tensors is
    then refused before converting."""
    from safetensors import safe_open

    args = [src, "--base-model", "org/tiny", "--scheme", "block", "--json"]
    proc = publish(tmp_path, hub, *args, "--format", "fp8")
    assert proc.returncode == 0, proc.stderr
    out = results(proc)["tester/tiny-FP8-Block"]
    assert out["status"] == "uploaded" and out["metrics"]["kl"] < 5e-3
    qc = json.loads(hub.file("tester/tiny-FP8-Block", "config.json"))["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(hub.file("tester/tiny-FP8-Block", "model.safetensors"))
    with safe_open(weights, "pt") as f:
        names = set(f.keys())
    assert any(n.endswith(".weight_scale_inv") for n in names) and not any(n.endswith(".weight_scale") for n in names)
    assert json.loads(hub.file("tester/tiny-FP8-Block", "fp8kit.json"))["format"] == "fp8"
    card = ModelCard(hub.file("tester/tiny-FP8-Block", "README.md").decode())
    assert "fp8" in card.data.tags and "compressed-tensors" not in card.data.tags
    assert "`weight_scale_inv`" in card.text and "--format fp8" in card.text
    assert next(tmp_path.joinpath("fp8cache").glob("local--tiny-llama-*/*/block-fp8-fp8kit*")).is_dir()
    overlay = (tmp_path / "overlay.toml").read_text()
    assert 'format = "fp8"' in overlay and 'scheme = "block"' in overlay
    env = {**os.environ, "FP8KIT_REGISTRY": str(tmp_path / "overlay.toml"), "FP8KIT_CACHE": str(tmp_path / "fp8cache"),
           "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    answer = subprocess.run([sys.executable, "-m", "fp8kit.cli", "resolve", "org/tiny", "--scheme", "block", "--json"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    resolved = json.loads(answer.stdout)
    assert (resolved["repo_id"], resolved["format"], resolved["source"]) == ("tester/tiny-FP8-Block", "fp8", "overlay")

    uploads = [r for r in hub.requests if r[0] == "POST"]
    proc = publish(tmp_path, hub, *args)  # compressed-tensors into the repo registered as fp8
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "as block (fp8), not block (compressed-tensors)" in proc.stderr
    assert [r for r in hub.requests if r[0] == "POST"] == uploads


@pytest.mark.parametrize("arch", ["gemma3_mm", "mistral3"])
def test_block_in_the_fp8_format_of_a_multimodal_model_validates(tmp_path, monkeypatch, arch):
    """transformers loads an fp8-format Gemma 3 it (or Mistral 3) with its norms, towers and embeddings in bfloat16
    whatever dtype is asked; validation in float32 failed on the mixed matmul. Mistral 3 in this format is now
    refused by fp8-convert (vLLM cannot load it): a failed row naming the fix, as any conversion error."""
    import torch

    from fp8kit.hub import publish as publish_api
    from fp8kit.models import build_checkpoint

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=1)
    [result] = publish_api(str(src), ["block"], base_model="org/tiny-it", org="me", dry_run=True, fmt="fp8",
                           staging=tmp_path / "staging")
    if arch == "mistral3":
        assert result.status == "failed" and "leave --format out" in result.error, result
        return
    assert result.status == "dry-run", result.error
    assert 0 < result.metrics["kl"] < 5e-3 and result.metrics["top1"] > 0.8
