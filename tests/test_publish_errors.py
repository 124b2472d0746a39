"""fp8kit publish: bad --repo-template and plan fields are one line before any work, no temporary staging
folder outlives a run, and a failed re-stage leaves the previous staging folder whole."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp8kit.cli import main
from test_publish import hub, publish, results, src  # noqa: F401 - hub and src are fixtures


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


def one_line_error(result) -> str:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("template", [
    "{org}/{name",           # ValueError: expected '}'
    "{org}/{name}}",         # ValueError: single '}'
    "{org}/{name.upper}",    # an attribute: formatted a bound method's repr into the repo id
    "{org}/{name[x]}",       # TypeError: string indices
    "{org}/{name:d}",        # ValueError: format code
    "{org}/{name!z}",        # ValueError: conversion
])
def test_malformed_repo_template_is_one_line_before_any_work(tmp_path, src, template):
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging"),
                                       "--repo-template", template])
    line = one_line_error(result)
    assert f"--repo-template {template!r}" in line and "{org}, {name}, {scheme} and {Scheme}" in line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_malformed_repo_template_is_refused_before_the_hub_is_asked(tmp_path, hub, src):
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--repo-template",
                   "{org}/{name")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--repo-template '{org}/{name'" in proc.stderr and "Traceback" not in proc.stderr
    assert hub.requests == [] and not (tmp_path / "fp8cache").exists()


GOOD = '[[model]]\nsrc = "{src}"\nbase_model = "org/tiny"\nschemes = ["dynamic"]\n'


@pytest.mark.parametrize("top,entry,needle", [
    ("", 'schemes = "dynamic"', "[[model]] number 2: 'schemes' must be a list"),
    ("", 'schemes = ["int4"]', "[[model]] number 2: 'schemes' has 'int4'"),
    ("", 'schemes = ["dynamic"]\nmax_kl = "0.01"', "[[model]] number 2: 'max_kl' must be a number"),
    ("", 'schemes = ["dynamic"]\nmax_kl = true', "[[model]] number 2: 'max_kl' must be a number"),
    ('max_kl = "0.01"\n', 'schemes = ["dynamic"]', "top level: 'max_kl' must be a number"),
    ("org = 3\n", 'schemes = ["dynamic"]', "top level: 'org' must be a non-empty string"),
    ("", 'schemes = ["dynamic"]\nbase_model = ["org/tiny"]', "[[model]] number 2: 'base_model' must be a non-empty"),
    ("", 'schemes = ["dynamic"]\nsrc = 5', "[[model]] number 2: 'src' must be a non-empty string"),
    ("", 'schemes = ["dynamic"]\nrepo_template = "{org}/{name"', "[[model]] number 2: 'repo_template' '{org}/{name'"),
    ("", 'schemes = ["dynamic"]\nmax-kl = 0.01', "[[model]] number 2: unknown key 'max-kl'"),
    ("", 'schemes = ["dynamic"]\nrepo_template = 3', "[[model]] number 2: 'repo_template' must be a string"),
    ("", 'schemes = ["block"]\nformat = "gguf"', "[[model]] number 2: 'format' must be 'compressed-tensors' or 'fp8'"),
    ('format = "fp8"\n', 'schemes = ["block"]\nbase_model = "org/b"', "top-level format (for [[model]] number 1) fp8: "
                                                                       "has no per-channel layout"),
    ("", 'schemes = ["block", "dynamic"]\nformat = "fp8"\nbase_model = "org/b"', "[[model]] number 2: format fp8: "
                                                                                "has no per-channel layout"),
    ("", 'schemes = ["tensor"]\nformat = "fp8"\nbase_model = "org/b"', "[[model]] number 2: format fp8: its "
                                                                      "per-tensor scales are not read by transformers"),
])
def test_plan_fields_are_type_checked_before_any_work(tmp_path, src, top, entry, needle):
    plan = tmp_path / "plan.toml"
    second = f'[[model]]\n{entry}\n'
    if "src =" not in entry:
        second += f'src = "{src}"\n'
    plan.write_text(top + GOOD.format(src=src) + second)
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging"), "--json"])
    line = one_line_error(result)
    assert line.startswith(f"error: {plan}: ") and needle in line, line
    assert result.stdout == ""  # no variant was converted, staged or reported
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_malformed_command_line_template_with_a_plan_is_refused_once(tmp_path, src):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src) * 2)
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging"), "--repo-template", "{org}/{name"])
    line = one_line_error(result)
    assert "--repo-template '{org}/{name'" in line and result.stdout == ""
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_publish_without_staging_leaves_no_temporary_folder(tmp_path, hub, src, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # publish() passes the environment on to the CLI
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json")
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.glob("fp8kit-publish-*")) == []
    result = results(proc)["tester/tiny-FP8-Dynamic"]
    assert result["status"] == "uploaded" and result["staging"] is None  # the report does not point at it

    hub.faults["/commit/"] = [500, 500, 500]  # a failed upload cleans up too
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "block", "--json")
    assert proc.returncode == 1 and results(proc)["tester/tiny-FP8-Block"]["status"] == "failed"
    assert list(tmp.glob("fp8kit-publish-*")) == []

    # a dry run keeps its staging folder: its report points there
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic", "--dry-run", "--org",
                   "tester", "--json")
    staged = results(proc)["tester/tiny-FP8-Dynamic"]["staging"]
    assert proc.returncode == 0 and staged.startswith(str(tmp)) and (Path(staged) / "README.md").exists()


RESTAGE = """
import resource, sys
from fp8kit.hub import publish
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
[result] = publish(sys.argv[1], ["dynamic"], base_model="org/tiny", org="me", dry_run=True, staging=sys.argv[2])
print(result.status, result.error)
"""


def test_failed_restage_leaves_the_previous_staging_folder_whole(tmp_path, src):
    from fp8kit.hub import publish as publish_api

    staging = tmp_path / "staging"
    [first] = publish_api(str(src), ["dynamic"], base_model="org/tiny", org="me", dry_run=True, staging=staging)
    folder = staging / "me--tiny-FP8-Dynamic"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert first.status == "dry-run" and {"README.md", "fp8kit.json", "model.safetensors"} <= set(before)

    # The conversion is cached, so the re-run only writes the card and fp8kit.json, and the card is over the
    # 1000-byte file size limit: a disk filling up in the middle of staging.
    assert len(before["README.md"]) > 1000
    proc = subprocess.run([sys.executable, "-c", RESTAGE, str(src), str(staging)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("failed OSError") and "too large" in proc.stdout, proc.stdout
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in staging.iterdir()) == ["me--tiny-FP8-Dynamic"]  # no temporary sibling left


def test_staging_folder_that_is_a_file_fails_that_variant(tmp_path, src):
    from fp8kit.hub import publish as publish_api

    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "me--tiny-FP8-Dynamic").write_text("mine")
    [result] = publish_api(str(src), ["dynamic"], base_model="org/tiny", org="me", dry_run=True, staging=staging)
    assert result.status == "failed" and "is not a folder" in result.error and "\n" not in result.error
    assert (staging / "me--tiny-FP8-Dynamic").read_text() == "mine"
    assert sorted(p.name for p in staging.iterdir()) == ["me--tiny-FP8-Dynamic"]


def test_broken_overlay_is_refused_before_any_work(tmp_path, hub, src):
    """Found after an upload, it left the variant on the Hub and unregistrable; now nothing is converted or sent."""
    (tmp_path / "overlay.toml").write_text("[[variant]\n")
    proc = publish(tmp_path, hub, src, "--base-model", "org/tiny", "--scheme", "dynamic")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(tmp_path / "overlay.toml") in proc.stderr and "Traceback" not in proc.stderr
    assert hub.requests == [] and not (tmp_path / "fp8cache").exists()


@pytest.mark.parametrize("args,needle", [(["--org", "my org"], "the Hub refuses this repo name"),
                                         (["--org", "me", "--base-model", "org/my--model"], "expected a Hub repo id"),
                                         (["--org", "me", "--base-model", "org/..", ], "expected a Hub repo id")],
                         ids=["space-in-org", "double-dash", "dots"])
def test_names_the_hub_refuses_are_refused_before_converting(tmp_path, src, args, needle):
    base = [] if "--base-model" in args else ["--base-model", "org/tiny"]
    result = CliRunner().invoke(main, ["publish", str(src), *base, *args, "--scheme", "dynamic", "--dry-run",
                                       "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert needle in line and ("--org" in line or "--base-model" in line), line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_checks_before_an_upload_are_retried(tmp_path, hub, src):
    args = [src, "--base-model", "org/tiny", "--scheme", "dynamic", "--json"]
    assert publish(tmp_path, hub, *args).returncode == 0
    # once each: repo_exists (the repo's own endpoint), list_repo_files (its tree) and the comparison with the repo
    hub.faults.update({"/api/models/tester/tiny-FP8-Dynamic": [503], "/tree/": [502], "/paths-info/": [503]})
    proc = publish(tmp_path, hub, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert results(proc)["tester/tiny-FP8-Dynamic"]["status"] == "unchanged"
    assert not any(hub.faults.values())  # every fault was met, and retried


def test_card_says_how_the_variant_was_made_not_how_this_run_was_called(tmp_path, src):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src))
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--json",
                                       "--staging", str(tmp_path / "staging")])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "README.md").read_text()
    made = card.split("## How it was made", 1)[1]
    assert f"fp8kit publish {src} --base-model org/tiny --scheme dynamic" in made
    for flag in ("--dry-run", "--staging", "--plan", "--json", str(plan)):
        assert flag not in made, flag


def test_unreadable_source_card_is_one_line(tmp_path, src):
    (src / "README.md").write_text("---\nlicense: [apache\n---\n# card\n")
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert str(src / "README.md") in line and "front matter" in line


def test_block_card_names_the_layers_kept_in_source_precision(tmp_path):
    """MLP width 320 is no multiple of 128: block FP8 keeps those layers; the card and the report say so."""
    import torch

    from fp8kit.models import build_checkpoint

    src = build_checkpoint(tmp_path / "odd", "llama", torch.bfloat16, seed=2, intermediate_size=320)
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/odd", "--scheme", "block",
                                       "--scheme", "dynamic", "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging")])
    assert result.exit_code == 0, result.output
    block = (tmp_path / "staging" / "me--odd-FP8-Block" / "README.md").read_text()
    assert "6 more Linear layers could not take this scheme" in block and "model.layers.0.mlp.down_proj" in block
    assert "6 Linear layers kept in the source precision" in result.stdout
    dynamic = (tmp_path / "staging" / "me--odd-FP8-Dynamic" / "README.md").read_text()
    assert "could not take this scheme" not in dynamic
    # the fp8 format lists them as modules_to_not_convert (it has no `ignore`): the card said nothing
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/odd", "--scheme", "block", "--format",
                                       "fp8", "--repo-template", "{org}/{name}-FP8", "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)[0]["kept_in_source_precision"]) == 6
    card = (tmp_path / "staging" / "me--odd-FP8" / "README.md").read_text()
    assert "6 more Linear layers" in card and "`quantization_config.modules_to_not_convert`" in card


def test_src_that_is_neither_a_folder_nor_a_repo_id_is_one_line(tmp_path):
    missing = tmp_path / "tiny-llamma"
    result = CliRunner().invoke(main, ["publish", str(missing), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert f"{missing}: no such folder" in line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_plan_with_a_local_src_and_no_base_model_is_refused_before_any_work(tmp_path, src):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src) + f'[[model]]\nsrc = "{src}"\nschemes = ["block"]\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert "[[model]] number 2" in line and "base_model" in line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()



@pytest.mark.parametrize("entry,needle", [
    ('base_model = "not a repo"', "[[model]] number 2: base_model 'not a repo' is not a Hub repo id ORG/NAME"),
    ('base_model = "org/tiny2"\norg = "bad org!"', "[[model]] number 2: bad org!/tiny2-FP8-Dynamic: the Hub refuses"),
])
def test_plan_names_the_hub_refuses_are_refused_before_any_work(tmp_path, src, entry, needle):
    """Checked as publish() checks them, but for every entry first: the first entry was converted and staged (in a
    real run, uploaded) before a later one's bad name was found."""
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src) + f'[[model]]\nsrc = "{src}"\nschemes = ["dynamic"]\n{entry}\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert needle in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_template_that_sends_two_schemes_to_one_repo_is_refused_before_any_work(tmp_path, src):
    """The second upload replaced the first under the scheme registered for it."""
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--scheme", "block", "--org", "me", "--repo-template", "{org}/{name}-FP8",
                                       "--dry-run", "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert "sends dynamic and block to the same repo me/tiny-FP8" in line and "{Scheme}" in line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_republishing_a_registered_repo_with_another_scheme_is_refused_before_converting(tmp_path, hub, src):
    """The Hub repo held block weights while the overlay still answered `resolve --scheme dynamic` with it."""
    args = [src, "--base-model", "org/tiny", "--repo-template", "{org}/{name}-FP8", "--json"]
    assert publish(tmp_path, hub, *args, "--scheme", "dynamic").returncode == 0
    overlay = (tmp_path / "overlay.toml").read_text()
    uploads = [r for r in hub.requests if r[0] == "POST"]
    proc = publish(tmp_path, hub, *args, "--scheme", "block")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "tester/tiny-FP8: registered in" in proc.stderr and "as dynamic" in proc.stderr
    assert (tmp_path / "overlay.toml").read_text() == overlay
    assert [r for r in hub.requests if r[0] == "POST"] == uploads
    assert not any(p.name.startswith("block") for p in (tmp_path / "fp8cache").glob("*/*/*"))


def test_overlay_that_cannot_be_written_is_refused_before_any_work(tmp_path, src, monkeypatch):
    """Found after the upload, it turned an uploaded variant into 'failed ... FileExistsError'."""
    (tmp_path / "cfg").write_text("a file where the overlay's folder should be")
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "cfg" / "registry.toml"))
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic"])
    line = one_line_error(result)
    assert str(tmp_path / "cfg" / "registry.toml") in line and "FP8KIT_REGISTRY" in line
    assert not (tmp_path / "fp8cache").exists()


def usage_error(result) -> str:
    """One `error:` line and exit 2, before any work."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf"])
def test_max_kl_that_is_not_a_positive_finite_number_is_refused_before_any_work(tmp_path, src, value):
    """--max-kl -1 or nan ran the whole conversion and validation, then rejected every variant."""
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging"),
                                       "--max-kl", value])
    line = one_line_error(result)
    assert "--max-kl" in line and ("positive" in line if value != "inf" else "checks nothing" in line), line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


@pytest.mark.parametrize("where,value", [("top", "-1"), ("top", "nan"), ("model", "0"), ("model", "inf")])
def test_plan_max_kl_that_is_not_a_positive_finite_number_is_refused_before_any_work(tmp_path, src, where, value):
    plan = tmp_path / "plan.toml"
    top = f"max_kl = {value}\n" if where == "top" else ""
    second = f'[[model]]\nsrc = "{src}"\nbase_model = "org/tiny2"\nschemes = ["dynamic"]\n'
    if where == "model":
        second += f"max_kl = {value}\n"
    plan.write_text(top + GOOD.format(src=src) + second)
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging")])
    line = one_line_error(result)
    assert line.startswith(f"error: {plan}: ") and "'max_kl'" in line, line
    assert ("positive" in line if value != "inf" else "checks nothing" in line), line
    assert ("top level" if where == "top" else "[[model]] number 2") in line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_publish_api_refuses_a_bad_max_kl_before_any_work(tmp_path, src):
    from fp8kit.errors import Fp8kitError
    from fp8kit.hub import publish as publish_api

    with pytest.raises(Fp8kitError, match="max_kl|--max-kl"):
        publish_api(str(src), ["dynamic"], base_model="org/tiny", org="me", dry_run=True,
                    staging=tmp_path / "staging", max_kl=float("nan"))
    assert not (tmp_path / "fp8cache").exists()


@pytest.mark.parametrize("extra,named", [
    (["{src}"], "SRC"),
    (["--base-model", "x/y"], "--base-model"),
    (["--scheme", "block"], "--scheme"),
    (["{src}", "--base-model", "x/y", "--scheme", "block"], "SRC, --base-model, --scheme"),
])
def test_plan_with_per_run_arguments_is_refused(tmp_path, src, extra, named):
    """SRC, --base-model and --scheme were silently ignored next to --plan."""
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src))
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), *[a.format(src=src) for a in extra],
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging")])
    line = usage_error(result)
    assert "--plan" in line and named in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


@pytest.mark.parametrize("key,option,value", [("org", "--org", "other"), ("max_kl", "--max-kl", "0.5"),
                                              ("repo_template", "--repo-template", "{org}/{name}-fp8-{scheme}"),
                                              ("format", "--format", "compressed-tensors")])
def test_plan_and_command_line_giving_the_same_default_is_refused(tmp_path, src, key, option, value):
    """--org, --max-kl, --repo-template and --format are the plan's defaults when it has none; both at once is
    ambiguous."""
    plan = tmp_path / "plan.toml"
    toml_value = value if key == "max_kl" else f'"{value}"'
    plan.write_text(f"{key} = {toml_value}\n" + GOOD.format(src=src))
    args = ["publish", "--plan", str(plan), "--dry-run", "--staging", str(tmp_path / "staging"), option, value]
    if key != "org":
        args += ["--org", "me"]
    line = usage_error(CliRunner().invoke(main, args))
    assert option in line and f"'{key}'" in line, line
    assert not (tmp_path / "fp8cache").exists()


def test_failed_dry_run_without_staging_leaves_no_temporary_folder(tmp_path, src, monkeypatch):
    """A dry run keeps its temporary staging folder only when it staged something its report points at."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process
    bad = tmp_path / "trunc"
    shutil.copytree(src, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(10_000)
    result = CliRunner().invoke(main, ["publish", str(bad), "--base-model", "me/tiny", "--scheme", "dynamic",
                                       "--org", "me", "--dry-run", "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)[0]["status"] == "failed", result.output
    assert json.loads(result.stdout)[0]["staging"] is None
    assert list(tmp.iterdir()) == []


def test_a_dry_run_without_org_says_why_it_needs_one(tmp_path, src, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 30)  # a token does not make a dry run contact the Hub
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic",
                                       "--dry-run"])
    line = one_line_error(result)
    assert "--dry-run contacts no server" in line and "--org" in line and "x" * 30 not in result.output


def test_a_repo_registered_for_another_base_model_is_refused_before_converting(tmp_path, src):
    """org-a/Foo and org-b/Foo fill the default template with the same name: the second publish replaced the first
    one's weights, and `resolve org-a/Foo` handed out org-b's."""
    from fp8kit.registry.catalog import Variant, append_to_overlay

    append_to_overlay(Variant("tester/Foo-7B-FP8-Dynamic", "foo", "dynamic", "compressed-tensors", ("dynamic",),
                              ("org-a/Foo-7B",), "overlay"))
    from fp8kit.hub.publish import _check_registered_schemes

    from fp8kit.errors import Fp8kitError

    with pytest.raises(Fp8kitError, match="registered in .* as an FP8 variant of org-a/Foo-7B, not org-b/Foo-7B"):
        _check_registered_schemes(["dynamic"], "compressed-tensors", "{org}/{name}-FP8-{Scheme}", "tester", "org-b/Foo-7B")
    _check_registered_schemes(["dynamic"], "compressed-tensors", "{org}/{name}-FP8-{Scheme}", "tester", "ORG-A/foo-7b")  # the same one


def test_plan_entries_that_land_in_one_repo_are_refused_before_any_work(tmp_path, src):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src).replace("org/tiny", "org-a/Foo")
                    + f'[[model]]\nsrc = "{src}"\nbase_model = "org-b/Foo"\nschemes = ["block", "dynamic"]\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "[[model]] number 1" in result.stderr and "number 2" in result.stderr and "me/Foo-FP8-Dynamic" in result.stderr
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_one_model_in_two_formats_into_one_repo_is_refused_before_any_work(tmp_path, src):
    """The dry run staged both into one folder (the fp8 one replaced the other); an upload registered the first and
    failed the second."""
    plan = tmp_path / "plan.toml"
    block = GOOD.format(src=src).replace('["dynamic"]', '["block"]')
    plan.write_text(block + block + 'format = "fp8"\n')
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me", "--staging",
                                       str(tmp_path / "staging")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "compressed-tensors) and number 2" in result.stderr and "fp8) both publish block to me/tiny-FP8-Block" \
        in result.stderr
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_a_dry_run_refuses_what_the_upload_would_refuse_before_any_work(tmp_path, src, monkeypatch):
    """A dry run skipped the overlay checks: it staged a variant (exit 0) that the upload then refused."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('[[variant]]\nrepo_id = "me/tiny-FP8-Dynamic"\nfamily = "tiny"\nscheme = "dynamic"\n'
                       'format = "compressed-tensors"\nserves = ["dynamic"]\nbase = ["someone-else/tiny"]\n')
    args = ["publish", str(src), "--base-model", "org/tiny", "--scheme", "dynamic", "--org", "me", "--dry-run",
            "--staging", str(tmp_path / "staging")]
    line = one_line_error(CliRunner().invoke(main, args))
    assert "me/tiny-FP8-Dynamic: registered in" in line and "someone-else/tiny, not org/tiny" in line, line
    overlay.write_text("[[variant]\n")
    line = one_line_error(CliRunner().invoke(main, args))
    assert str(overlay) in line and "not valid TOML" in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()
    # an overlay that cannot be written is the upload's concern: a dry run writes nothing there
    (tmp_path / "cfg").write_text("a file where the overlay's folder should be")
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "cfg" / "registry.toml"))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "staging" / "me--tiny-FP8-Dynamic" / "model.safetensors").exists()


def test_failed_plan_rows_name_the_repo_they_were_to_publish(tmp_path, src, monkeypatch):
    """They named the SRC (a local path) as their repo_id."""
    plan = tmp_path / "plan.toml"
    plan.write_text('org = "me"\n' + GOOD.format(src=src) + 'repo_template = "{org}/{name}-fp8-{scheme}"\n')
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--json"])  # no token: that entry fails
    assert result.exit_code == 1, result.output
    [row] = json.loads(result.stdout)
    assert (row["repo_id"], row["status"]) == ("me/tiny-fp8-dynamic", "failed")
    assert "no Hugging Face token" in row["error"]


def test_plan_nested_too_deeply_is_one_line(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text("org = " + "[" * 5000 + "]" * 5000 + "\n")
    line = one_line_error(CliRunner().invoke(main, ["publish", "--plan", str(plan), "--dry-run", "--org", "me"]))
    assert line.startswith(f"error: {plan}: cannot read the plan") and "nested too deeply" in line, line


def test_publish_with_hf_hub_offline_says_to_unset_it(tmp_path, src, monkeypatch):
    """It said "re-run to resume", which can never work while HF_HUB_OFFLINE is set."""
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 30)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    line = one_line_error(CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme",
                                                    "dynamic"]))
    assert "HF_HUB_OFFLINE" in line and "--dry-run" in line and "re-run" not in line and "x" * 30 not in line, line
    assert not (tmp_path / "fp8cache").exists()


def test_format_fp8_with_a_per_channel_scheme_is_one_line_before_any_work(tmp_path, src):
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/tiny", "--scheme", "block",
                                       "--scheme", "dynamic", "--format", "fp8", "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert "--format fp8: has no per-channel layout" in line and "compressed-tensors" in line, line
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "staging").exists()


def test_command_line_format_reaches_plan_entries_and_is_checked_before_any_work(tmp_path, src):
    """A plan without format takes --format; an entry with a scheme that format cannot hold is refused up front."""
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.format(src=src).replace('["dynamic"]', '["block"]') + GOOD.format(src=src))
    result = CliRunner().invoke(main, ["publish", "--plan", str(plan), "--format", "fp8", "--dry-run", "--org", "me",
                                       "--staging", str(tmp_path / "staging")])
    line = one_line_error(result)
    assert f"--format (for {plan}'s [[model]] number 2) fp8: has no per-channel layout" in line, line
    assert result.stdout == "" and not (tmp_path / "fp8cache").exists()


def test_a_nan_metric_is_null_in_the_json_report_and_the_provenance_file(tmp_path, llama_dir):
    """A source whose logits overflow validates with a NaN KL: `--json` and the staged fp8kit.json held `NaN`, which
    is not JSON (strict parsers refuse it)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "overflowing"
    shutil.copytree(llama_dir, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float().fill_(1e37).to(tensors["model.norm.weight"].dtype)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["publish", str(src), "--base-model", "org/nan", "--scheme", "dynamic",
                                       "--dry-run", "--org", "me", "--staging", str(tmp_path / "staging"), "--json"])
    assert result.exit_code == 0, result.output

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))

    [row] = strict(result.stdout)
    assert row["metrics"]["kl"] is None or row["metrics"]["ppl_ratio"] is None, row["metrics"]
    strict((Path(row["staging"]) / "fp8kit.json").read_text())
