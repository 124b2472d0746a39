"""`fp8kit publish`: convert, validate, write the card, upload with huggingface_hub, register.

Every variant is staged as a folder holding exactly what is uploaded (weights, configs, tokenizer,
README.md card, fp8kit.json provenance). An upload compares that folder with the repo first and sends
nothing when the repo already holds the same files; the registry overlay is only written after an upload
succeeded, so an interrupted run registers nothing and a re-run resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp8kit.errors import Fp8kitError

PROVENANCE = "fp8kit.json"
SCHEMES = ("dynamic", "block", "tensor", "tensor-static")
SCHEME_NAMES = "dynamic, block, tensor or tensor-static"


def json_safe(value):
    """`value` with every non-finite float as None: json.dumps writes NaN and Infinity, which are not JSON (a strict
    parser, or the Hub's, refuses them), and a source whose logits overflow validates with a NaN KL."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass
class PublishResult:
    repo_id: str
    scheme: str
    status: str  # uploaded | unchanged | dry-run | rejected | failed
    metrics: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # name -> bytes
    staging: str | None = None
    url: str | None = None
    error: str | None = None
    kept_in_source_precision: list = field(default_factory=list)  # Linear layers the scheme could not take

    def to_dict(self) -> dict:
        """As JSON holds it: a NaN metric is null."""
        return json_safe(asdict(self))


class PublishInterrupted(KeyboardInterrupt):
    """Ctrl-C, or SIGTERM where fp8kit turns it into one (fp8kit.converter.output.sigterm_as_interrupt), during
    publish()'s work on a variant: raised once that variant's temporary files are removed; str() is one line
    naming the variant and the step, and what is left."""


# What publish can validate in each format. The fp8 format has no per-channel layout, and its per-tensor layout
# (vLLM's and SGLang's `weight_scale`) is read by transformers 5.x as blocks with `weight_scale_inv`: the scales are
# skipped and validation would measure a broken model (KL ~0.1), so it is not published from here.
PUBLISHABLE = {"compressed-tensors": SCHEMES, "fp8": ("block",)}
FORMATS = tuple(PUBLISHABLE)


def check_format(fmt, schemes, where: str = "--format") -> None:
    """The format holds every scheme asked for, in a layout transformers reads for validation."""
    if fmt not in FORMATS:
        raise Fp8kitError(f"{where} {fmt!r}: expected {' or '.join(FORMATS)}")
    bad = next((s for s in schemes if s not in PUBLISHABLE[fmt]), None)
    if bad == "dynamic":
        raise Fp8kitError(f"{where} {fmt}: has no per-channel layout; publish dynamic in the compressed-tensors "
                          f"format separately, or drop it")
    if bad == "tensor-static":
        raise Fp8kitError(f"{where} {fmt}: tensor-static is written in the compressed-tensors format only (as "
                          f"llm-compressor writes it); publish it in that format separately, or drop it")
    if bad == "tensor":
        raise Fp8kitError(f"{where} {fmt}: its per-tensor scales are not read by transformers, so the variant cannot be "
                          f"validated; publish tensor in the compressed-tensors format separately, or drop it "
                          f"(`fp8-convert --format fp8 --scheme tensor` writes it for vLLM and SGLang)")


def check_max_kl(value, where: str = "--max-kl") -> None:
    """A mean KL bound is a positive finite number: -1, 0 or NaN would reject every variant after all the work."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Fp8kitError(f"{where} must be a number, e.g. 0.01 (not {value!r})")
    if value == math.inf:
        raise Fp8kitError(f"{where} {value!r}: an infinite bound checks nothing; leave it out to accept any KL, or "
                          f"give the highest mean KL to accept (e.g. 0.01)")
    if not math.isfinite(value) or value <= 0:
        raise Fp8kitError(f"{where} {value!r}: must be a positive finite number, the highest mean KL to accept "
                          f"(e.g. 0.01); it would reject every variant")


TEMPLATE_FIELDS = ("org", "name", "scheme", "Scheme")
TEMPLATE_HINT = "use only the fields {org}, {name}, {scheme} and {Scheme}, e.g. '{org}/{name}-FP8-{Scheme}'"


def check_repo_template(template, where: str = "--repo-template") -> None:
    """Refuse a template that str.format cannot fill with our fields, or that does not give org/name,
    before any work is done. `where` names the option or plan entry the template came from."""
    from string import Formatter

    from fp8kit.registry.catalog import is_repo_name

    if not isinstance(template, str):
        raise Fp8kitError(f"{where} must be a string; {TEMPLATE_HINT}")
    try:
        fields = [f for _, f, _, _ in Formatter().parse(template) if f is not None]
        bad = next((f for f in fields if f not in TEMPLATE_FIELDS), None)
        if bad is not None:
            raise Fp8kitError(f"{where} {template!r}: unknown field {{{bad}}}; {TEMPLATE_HINT}")
        sample = template.format(org="org", name="name", scheme="dynamic", Scheme="Dynamic")
    except KeyError as e:  # a field nested in a format spec: {name:>{width}}
        raise Fp8kitError(f"{where} {template!r}: unknown field {{{e.args[0]}}}; {TEMPLATE_HINT}") from e
    except (ValueError, TypeError, IndexError, AttributeError) as e:  # "Single '}'", a bad format spec, ...
        raise Fp8kitError(f"{where} {template!r}: {e}; {TEMPLATE_HINT}") from e
    if not is_repo_name(sample):
        raise Fp8kitError(f"{where} {template!r} gives {sample!r}, not a repo id org/name; {TEMPLATE_HINT}")


def repo_id_for(template: str, org: str, base_model: str, scheme: str) -> str:
    """`template` filled in; publish() has refused a malformed one with check_repo_template. {Scheme} capitalizes each
    part: Dynamic, Tensor-Static."""
    name = base_model.split("/")[-1]
    title = "-".join(part.capitalize() for part in scheme.split("-"))
    repo_id = template.format(org=org, name=name, scheme=scheme, Scheme=title)
    if repo_id.count("/") != 1:
        raise Fp8kitError(f"--repo-template {template!r} gives {repo_id!r}, not org/name")
    return repo_id


def check_hub_names(repo_ids: list[str]) -> None:
    """Each repo id refused in one line where the Hub would refuse its name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for repo_id in repo_ids:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as e:
            raise Fp8kitError(f"{repo_id}: the Hub refuses this repo name ({str(e).splitlines()[0]}); change --org, "
                              f"--base-model or --repo-template") from e


def token_user(api=None) -> str:
    """The Hub user the token belongs to (the default org), or one line saying why there is none."""
    from huggingface_hub import HfApi, get_token

    if not get_token():
        raise Fp8kitError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (or use --dry-run)")
    try:
        return (api or HfApi()).whoami()["name"]
    except Exception as e:  # noqa: BLE001
        raise _http_error(e, "whoami") from e


def _http_error(e: Exception, repo_id: str) -> Fp8kitError:
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):  # a re-run cannot get further while it is set
        return Fp8kitError("HF_HUB_OFFLINE is set, so the Hub cannot be reached: unset HF_HUB_OFFLINE to publish, or "
                           "pass --dry-run to convert, validate and stage without uploading")
    status = getattr(getattr(e, "response", None), "status_code", None)
    reasons = {401: "the Hub rejected the token (401): log in again with `hf auth login` or set HF_TOKEN",
               403: f"no write access to {repo_id} (403): check the token's permissions and the organization",
               404: f"{repo_id}: not found (404)",
               429: "rate limited by the Hub (429): wait and re-run; finished uploads are kept and skipped"}
    text = reasons.get(status) or (f"the Hub answered {status}: re-run to resume; finished uploads are kept"
                                   if status else f"cannot reach the Hub ({e.__class__.__name__}): re-run to resume")
    return Fp8kitError(f"{repo_id}: {text}" if not text.startswith(repo_id) else text)


def _git_blob_sha(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _identical_on_hub(api, repo_id: str, staging: Path, remote_files: set[str]) -> bool:
    """True when the repo holds exactly the staged files (`remote_files` leaves out .gitattributes, which the Hub
    needs and upload_folder never deletes), each with the same content (LFS sha256 or git blob id). A file staged
    no longer is a difference too: a stale shard or index would be loaded with ours, a stale chat template or
    tokenizer file used with our weights."""
    from fp8kit.converter.source import folder_files

    names = folder_files(staging)  # chat templates live in a subfolder

    if set(remote_files) - set(names):
        return False
    remote = {info.path: info for info in _with_retries(lambda: api.get_paths_info(repo_id, names, expand=False))}
    for name in names:
        info = remote.get(name)
        if info is None or not hasattr(info, "blob_id"):
            return False
        lfs = getattr(info, "lfs", None)
        if lfs is not None:
            if lfs.sha256 != _sha256(staging / name):
                return False
        elif info.blob_id != _git_blob_sha(staging / name):
            return False
    return True


def _stage(conversion: Path, staging: Path, card, provenance: dict) -> dict:
    """Fill a temporary sibling of `staging` and swap it in once complete: a failure leaves the previous
    staging folder (if any) as it was, and no half-filled one."""
    from fp8kit.converter.source import folder_files

    if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
        raise Fp8kitError(f"{staging}: exists and is not a folder; remove it or choose another --staging")
    staging.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging.with_name(f".{staging.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    old = tmp.with_suffix(".old")
    tmp.mkdir()
    try:
        for rel in folder_files(conversion):
            # the card and provenance are written fresh: a hard link would let them overwrite the cache's files
            if not rel.startswith("fp8kit-entry") and rel not in ("README.md", PROVENANCE):
                (tmp / rel).parent.mkdir(exist_ok=True)
                try:
                    os.link(conversion / rel, tmp / rel)  # the cache and the staging folder share the weight bytes
                except OSError:
                    shutil.copyfile(conversion / rel, tmp / rel)
        card.save(tmp / "README.md")
        (tmp / PROVENANCE).write_text(json.dumps(json_safe(provenance), indent=2, sort_keys=True, allow_nan=False)
                                      + "\n")
        if staging.exists():
            os.replace(staging, old)
        try:
            os.replace(tmp, staging)
        except BaseException:
            if old.exists():
                os.replace(old, staging)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return {rel: (staging / rel).stat().st_size for rel in folder_files(staging)}


def _with_retries(fn, attempts: int = 3):
    """Rate limits and server errors are retried; the Hub client already retries connection errors."""
    wait = float(os.environ.get("FP8KIT_HUB_RETRY_SECONDS", "5"))
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - huggingface_hub raises several HTTP error types
            status = getattr(getattr(e, "response", None), "status_code", None)
            if i == attempts - 1 or not (status == 429 or (status or 0) >= 500):
                raise
            time.sleep(wait * 2 ** i)


def publish(src: str, schemes: list[str], base_model: str | None = None,
            repo_template: str = "{org}/{name}-FP8-{Scheme}", org: str | None = None, private: bool = False,
            create_pr: bool = False, max_kl: float | None = None, dry_run: bool = False,
            staging: str | Path | None = None, force: bool = False, command: str | None = None,
            fmt: str = "compressed-tensors", kv_cache: str | None = None, calibration: str | Path | None = None,
            lm_head: bool = False, ignore: list[str] | tuple[str, ...] = ()) -> list[PublishResult]:
    """`kv_cache`, `calibration`, `lm_head` and `ignore` are fp8-convert's options: a variant made with any of them
    is converted for this call (in the staging folder) instead of taken from the registry's cache, whose entries
    are the plain conversions that `resolve` hands out (tensor-static's calibrated on the shipped sample)."""
    from fp8kit import __version__
    from fp8kit.converter import convert, source
    from fp8kit.quality import quiet
    from fp8kit.hub.card import build_card, kept_layers, source_terms
    from fp8kit.hub.validate import sample_ids, validate
    from fp8kit.converter.output import sigterm_as_interrupt
    from fp8kit.registry.cache import cached_conversion
    from fp8kit.registry.catalog import is_repo_name

    local = Path(src).expanduser().is_dir()
    if local and not base_model:
        raise Fp8kitError(f"{src}: a local SRC needs --base-model ORG/NAME (it names the source on the card)")
    if not local and not source.is_repo_id(src):
        raise Fp8kitError(f"{src}: no such folder, and not a Hub repo id ORG/NAME[@REVISION]")
    base_model = base_model or src.partition("@")[0]
    if not is_repo_name(base_model):
        raise Fp8kitError(f"--base-model {base_model!r}: expected a Hub repo id ORG/NAME")
    for scheme in schemes:
        if scheme not in SCHEMES:
            raise Fp8kitError(f"--scheme {scheme!r}: expected {SCHEME_NAMES}")
    check_format(fmt, schemes)
    ignore = list(ignore)
    check_variant_options(schemes, fmt, ignore, lm_head, kv_cache, calibration)
    # each variant's options as fp8kit.json records them; reads the calibration text now
    options_of = {scheme: conversion_options(kv_cache, calibration, lm_head, ignore, scheme) for scheme in schemes}
    check_repo_template(repo_template)
    check_max_kl(max_kl)
    if not create_pr:  # a broken or unwritable overlay found now, not after an upload (a dry run: see _check_overlay)
        _check_overlay(writable=not dry_run)
    api = None
    if not dry_run:  # the token is checked before any conversion work
        from huggingface_hub import HfApi

        api = HfApi()
        user = token_user(api)  # also where org is given: no token, or a rejected one, fails here
        org = org or user
    if not org:  # a dry run contacts no server, so the token's user is not looked up
        raise Fp8kitError("--dry-run contacts no server, so it needs --org ORG to name the repos")
    repo_ids = [repo_id_for(repo_template, org, base_model, scheme) for scheme in schemes]
    try:
        check_hub_names(repo_ids)  # before converting (and in a dry run)
        seen: dict[str, str] = {}
        for scheme, repo_id in zip(schemes, repo_ids):  # a later upload would replace an earlier one under its name
            if seen.setdefault(repo_id.lower(), scheme) != scheme:
                raise Fp8kitError(f"--repo-template {repo_template!r} sends {seen[repo_id.lower()]} and {scheme} to "
                                  f"the same repo {repo_id}; put {{Scheme}} or {{scheme}} in it")
        if not create_pr:  # in a dry run too: it would succeed where the upload is refused
            _check_registered_schemes(schemes, fmt, repo_template, org, base_model)
        src_dir = source.resolve(src)
        terms = source_terms(src_dir)
        try:  # a broken tokenizer is named before converting, not after
            sample = sample_ids(src_dir)
        except Fp8kitError:
            raise
        except Exception:  # noqa: BLE001 - no readable config.json, say: the variant's conversion names what is wrong
            sample = None
    except Fp8kitError as e:
        e.repo_ids = repo_ids  # a plan reports the failed entry's variants under their repos (the token's user known)
        raise

    def made_by(scheme: str) -> str:
        """The card's command: the variant's own (one scheme), from this call's arguments, never from the host
        process's command line."""
        if command is not None:
            return command
        return shlex.join(["fp8kit", "publish", str(src), "--base-model", base_model, "--scheme", scheme,
                           "--org", org, "--repo-template", repo_template]
                          + (["--format", fmt] if fmt != "compressed-tensors" else [])
                          + convert_args(kv_cache, calibration, lm_head, ignore, scheme)
                          + (["--max-kl", repr(float(max_kl))] if max_kl is not None else []))
    # A staging folder of our own (no --staging) is removed when done, uploaded or not; a dry run keeps it only
    # when its report points there (something was staged and the run was not interrupted).
    # Named before it is made, and made inside the try: a signal as mkdir returns still finds it in the finally.
    staging_root = Path(staging) if staging else Path(tempfile.gettempdir()) / f"fp8kit-publish-{secrets.token_hex(8)}"
    made_staging = staging and not staging_root.exists()  # a run's own conversion creates it: removed if left empty
    results = []
    finished = False
    step, repo_id = "starting", ""
    try:
        with sigterm_as_interrupt():  # SIGTERM, like Ctrl-C, leaves no temporary folder (from Python too)
            if not staging:
                staging_root.mkdir(mode=0o700)  # as tempfile.mkdtemp makes it
            for scheme, repo_id in zip(schemes, repo_ids):
                own = None  # this call's conversion, removed once staged
                options = options_of[scheme]
                try:
                    step = "converting"
                    # the registry's cache holds plain conversions, tensor-static's calibrated on the shipped sample
                    if not from_cache(scheme, kv_cache, calibration, lm_head, ignore):
                        own = staging_root / f".{repo_id.replace('/', '--')}.conversion.{secrets.token_hex(4)}"
                        with quiet():  # transformers' loading bar, while calibrating: as quiet as the cache's
                            report = convert(src_dir, own, scheme=scheme, format=fmt, ignore=ignore,
                                             lm_head=lm_head, kv_cache=kv_cache,
                                             calibration=calibration if calibrates(scheme, kv_cache) else None)
                        conversion = own
                        if report.unmatched_ignore:  # fp8-convert warns; the card would name it as keeping layers
                            raise Fp8kitError(f"{src}: --ignore {', '.join(map(repr, report.unmatched_ignore))} "
                                              f"matched no weight (patterns are searched in module names, without "
                                              f"'.weight'); correct or drop it")
                    else:
                        conversion = cached_conversion(str(src_dir) if local else src, scheme, fmt)
                    step = "validating"
                    metrics = validate(src_dir, conversion, sample=sample)
                    kept = kept_layers(conversion)
                    card = build_card(repo_id, base_model, scheme, fmt, metrics, made_by(scheme), terms, kept, options)
                    provenance = {"tool": "fp8kit", "version": __version__, "base_model": base_model, "scheme": scheme,
                                  "format": fmt, "validation": metrics, **options}
                    folder = staging_root / repo_id.replace("/", "--")
                    step = "staging"
                    files = _stage(conversion, folder, card, provenance)
                    result = PublishResult(repo_id, scheme, "dry-run", metrics, files, str(folder),
                                           kept_in_source_precision=kept)
                    if max_kl is not None and not metrics["kl"] <= max_kl:  # a NaN KL is rejected too
                        result.status, result.error = "rejected", f"KL {metrics['kl']:.3e} is over --max-kl {max_kl:g}"
                    elif not dry_run:
                        step = "uploading"
                        _upload(api, result, folder, private, create_pr, force)
                        if not create_pr:
                            step = "registering"
                            _register(repo_id, scheme, fmt, base_model)
                except Fp8kitError as e:
                    result = PublishResult(repo_id, scheme, "failed", error=str(e))
                except Exception as e:  # noqa: BLE001 - e.g. transformers cannot load the model: one line, go on
                    first = (str(e).strip().splitlines() or [""])[0]
                    result = PublishResult(repo_id, scheme, "failed", error=f"{type(e).__name__}: {first}")
                finally:
                    if own is not None:  # the staged files are hard links (or copies) of its files
                        shutil.rmtree(own, ignore_errors=True)
                results.append(result)
                step = "finishing"
        finished = True
    except KeyboardInterrupt as e:
        raise PublishInterrupted(_interrupted(step, repo_id, any(r.status == "uploaded" for r in results))) from e
    finally:
        if made_staging:
            with contextlib.suppress(OSError):  # only while empty
                staging_root.rmdir()
        if not staging and not (finished and dry_run and any(r.staging for r in results)):
            shutil.rmtree(staging_root, ignore_errors=True)
            for result in results:
                result.staging = None  # removed: the report does not point at it
    return results


def calibrates(scheme: str, kv_cache: str | None) -> bool:
    """Whether a variant runs the model over calibration text: tensor-static's activation scales, --kv-cache's."""
    return scheme == "tensor-static" or bool(kv_cache)


def from_cache(scheme: str, kv_cache: str | None, calibration, lm_head: bool, ignore) -> bool:
    """Whether a variant is the registry cache's conversion (`ensure(name, scheme)`'s): none of fp8-convert's options,
    and for tensor-static no calibration text but the shipped sample."""
    return not (kv_cache or lm_head or ignore) and (scheme != "tensor-static" or calibration is None)


def check_variant_options(schemes, fmt, ignore, lm_head, kv_cache, calibration) -> None:
    """fp8-convert's checks of each variant's options; --calibration is given to the variants that calibrate, and
    refused (fp8-convert's line) where none does."""
    from fp8kit.converter.streaming import check_options

    for scheme in schemes:
        check_options(scheme, fmt, ignore, lm_head, kv_cache, calibration if calibrates(scheme, kv_cache) else None)
    if calibration is not None and not any(calibrates(s, kv_cache) for s in schemes):
        check_options(schemes[0], fmt, ignore, lm_head, kv_cache, calibration)


def convert_args(kv_cache: str | None, calibration: str | Path | None, lm_head: bool, ignore: list[str],
                 scheme: str) -> list[str]:
    """fp8-convert's options as its command line gives them for a variant of `scheme`; the calibration file by its
    name: the host's path means nothing to a reader of the card (fp8kit.json has its sha256)."""
    return ((["--kv-cache", kv_cache] if kv_cache else [])
            + (["--calibration", Path(calibration).name] if calibration and calibrates(scheme, kv_cache) else [])
            + (["--lm-head"] if lm_head else [])
            + [arg for pattern in ignore for arg in ("--ignore", pattern)])


def conversion_options(kv_cache: str | None, calibration: str | Path | None, lm_head: bool, ignore: list[str],
                       scheme: str) -> dict:
    """fp8-convert's options a variant of `scheme` was made with, as fp8kit.json records them and the card describes
    them (empty for a plain conversion): the calibration text by its file name and sha256 (tensor-static is always
    calibrated, on the shipped sample by default)."""
    from fp8kit.converter.calibration import DEFAULT_CALIBRATION, read_calibration

    options = {}
    if kv_cache:
        options["kv_cache"] = kv_cache
    if calibrates(scheme, kv_cache):
        path, _ = read_calibration(calibration)  # as the conversion reads it: one line where it cannot
        options["calibration"] = {"file": f"{path.name} (shipped with fp8kit)" if path == DEFAULT_CALIBRATION
                                  else path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    if lm_head:
        options["lm_head"] = True
    if ignore:
        options["ignore"] = list(ignore)
    return options


def _interrupted(step: str, repo_id: str, uploaded_before: bool) -> str:
    """The line an interrupted publish() ends with: the step and variant, and what was left."""
    earlier = "; variants uploaded before it are kept" if uploaded_before else ""
    if step in ("converting", "validating", "staging"):
        return f"interrupted while {step} {repo_id}; nothing partial was left{earlier}"
    if step == "uploading":
        return (f"interrupted while uploading {repo_id}; a Hub commit is all or nothing and it was not registered: "
                f"re-run to resume{earlier}")
    if step == "registering":
        return (f"interrupted while registering {repo_id}: it is uploaded, but may be missing from the registry "
                f"overlay; re-run to register it (nothing is uploaded again){earlier}")
    return f"interrupted; nothing partial was left{earlier}"


def _upload(api, result: PublishResult, folder: Path, private: bool, create_pr: bool, force: bool) -> None:
    repo_id = result.repo_id
    try:
        if _with_retries(lambda: api.repo_exists(repo_id)):
            # A repo with content but no provenance file is someone else's work; an empty one (say, left by
            # an interrupted first upload of ours) has nothing to overwrite.
            remote = set(_with_retries(lambda: api.list_repo_files(repo_id))) - {".gitattributes"}
            if remote and PROVENANCE not in remote and not force:
                raise Fp8kitError(f"{repo_id}: exists and was not made by fp8kit (no {PROVENANCE}); pass --force to "
                                  f"upload into it")
            if PROVENANCE in remote and not force:
                _check_remote_base(api, repo_id, folder)
            if _identical_on_hub(api, repo_id, folder, remote):
                result.status, result.url = "unchanged", f"{api.endpoint}/{repo_id}"
                return
        _with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True))
        # The repo mirrors the staged folder: every other file (an earlier layout's shards and index, a chat template
        # or tokenizer file the source dropped) is deleted in the same commit. "*" matches across folders in
        # huggingface_hub's patterns, files uploaded again are not deleted, and .gitattributes never is.
        info = _with_retries(lambda: api.upload_folder(repo_id=repo_id, folder_path=folder, create_pr=create_pr,
                                                       delete_patterns=["*"],
                                                       commit_message=f"FP8 {result.scheme} variant (fp8kit)"))
    except Fp8kitError:
        raise
    except Exception as e:  # noqa: BLE001 - HTTP and connection errors from huggingface_hub
        raise _http_error(e, repo_id) from e
    result.status = "uploaded"
    result.url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None)


def _check_remote_base(api, repo_id: str, folder: Path) -> None:
    """An fp8kit repo made from another base model (org-a/Foo and org-b/Foo fill the default template alike, also
    from another machine, whose overlay this one never saw) or in another scheme or format (a template without
    {scheme}) is not replaced: its users, and registries that list it by its scheme, would get other weights."""
    staged = json.loads((folder / PROVENANCE).read_text())
    ours = staged.get("base_model")
    try:
        theirs = json.loads(Path(_with_retries(lambda: api.hf_hub_download(repo_id, PROVENANCE))).read_text())
    except ValueError as e:  # whose weights it holds cannot be told: as for a repo without provenance
        raise Fp8kitError(f"{repo_id}: its {PROVENANCE} is not readable JSON ({e}), so which model it holds cannot be "
                          f"checked; pass --force to upload into it") from e
    base = theirs.get("base_model") if isinstance(theirs, dict) else None
    if not isinstance(base, str):  # fp8kit always writes it: this file is not ours, or was edited
        raise Fp8kitError(f"{repo_id}: its {PROVENANCE} names no base model, so which model it holds cannot be "
                          f"checked; pass --force to upload into it")
    if base.lower() != str(ours).lower():
        raise Fp8kitError(f"{repo_id}: holds fp8kit's FP8 variant of {base} (its {PROVENANCE}), not of {ours}; "
                          f"publish under another --repo-template or --org, or pass --force to replace it")
    differing = [key for key in ("scheme", "format") if key in theirs and theirs[key] != staged.get(key)]
    if differing:
        held = ", ".join(f"{key} {theirs[key]}" for key in differing)
        wanted = ", ".join(f"{key} {staged.get(key)}" for key in differing)
        raise Fp8kitError(f"{repo_id}: holds fp8kit's variant of {base} with {held} (its {PROVENANCE}), not {wanted}; "
                          f"publish under a --repo-template with {{scheme}} (and another --org or name for another "
                          f"format), or pass --force to replace it")


def _check_overlay(writable: bool = True) -> None:
    """The overlay parses and its folder can be written: checked before any conversion or upload. A dry run
    (`writable=False`) checks that it parses, as its entries decide what an upload from here refuses, but not that it
    can be written: a dry run writes nothing there, and is also how one stages on a machine that does not publish
    (a read-only home, a container); the upload still checks it before any work."""
    import os

    from fp8kit.registry.catalog import load, overlay_path

    load()
    if not writable:
        return
    path = overlay_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        raise Fp8kitError(f"{path}: the registry overlay cannot be written there ({e.strerror}); set FP8KIT_REGISTRY "
                          f"to a writable file, or pass --dry-run or --create-pr; nothing was uploaded") from e


def _check_registered_schemes(schemes, fmt, repo_template, org, base_model) -> None:
    """A repo the overlay registers with another scheme or format is refused before converting: uploading there would
    make `resolve` hand out these weights under the old scheme or format."""
    from fp8kit.registry.catalog import load, overlay_path

    registered = {v.repo_id.lower(): v for v in load() if v.source == "overlay"}
    for scheme in schemes:
        repo_id = repo_id_for(repo_template, org, base_model, scheme)
        old = registered.get(repo_id.lower())
        if old is not None and (old.scheme, old.format) != (scheme, fmt):
            raise Fp8kitError(f"{repo_id}: registered in {overlay_path()} as {old.scheme} ({old.format}), not {scheme} "
                              f"({fmt}); publish {scheme} under another --repo-template, or remove that entry first")
        # two models of one name (an upstream model and someone's finetune) fill the same default repo name
        if old is not None and base_model.lower() not in (b.lower() for b in old.base):
            raise Fp8kitError(f"{repo_id}: registered in {overlay_path()} as an FP8 variant of {', '.join(old.base)}, "
                              f"not {base_model}; publish under another --repo-template or --org, or remove that "
                              f"entry first")


def _register(repo_id: str, scheme: str, fmt: str, base_model: str) -> None:
    from fp8kit.registry.catalog import Variant, append_to_overlay, load, overlay_path

    variants = load()
    if any(v.repo_id.lower() == repo_id.lower() and v.source == "overlay" for v in variants):
        return
    family = next((v.family for v in variants if base_model.lower() in (b.lower() for b in v.base)),
                  base_model.split("/")[-1].lower())
    append_to_overlay(Variant(repo_id, family, scheme, fmt, (scheme,), (base_model,), "overlay"), overlay_path())


# fp8-convert's options, also as a plan's keys (top level and [[model]])
CONVERT_OPTIONS = {"kv_cache", "calibration", "lm_head", "ignore"}
PLAN_TOP = {"org", "max_kl", "repo_template", "format", "model"} | CONVERT_OPTIONS
PLAN_MODEL = {"src", "schemes", "base_model", "org", "max_kl", "repo_template", "format"} | CONVERT_OPTIONS


def _check_plan_field(where: str, key: str, value) -> None:
    """One plan field, top-level or in a [[model]] table: its type, and for schemes and repo_template what they hold."""
    if key in ("src", "base_model", "org", "calibration") and not (isinstance(value, str) and value.strip()):
        raise Fp8kitError(f"{where}: '{key}' must be a non-empty string (not {value!r})")
    if key == "max_kl":
        check_max_kl(value, f"{where}: 'max_kl'")
    if key == "schemes":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
            raise Fp8kitError(f"{where}: 'schemes' must be a list of scheme names, e.g. "
                              f"schemes = [\"dynamic\", \"block\"] (not {value!r})")
        bad = [s for s in value if s not in SCHEMES]
        if bad:
            raise Fp8kitError(f"{where}: 'schemes' has {bad[0]!r}; use {SCHEME_NAMES}")
    if key == "repo_template":
        check_repo_template(value, f"{where}: 'repo_template'")
    if key == "format" and value not in FORMATS:
        raise Fp8kitError(f"{where}: 'format' must be {' or '.join(repr(f) for f in FORMATS)} (not {value!r})")
    if key == "kv_cache" and value not in ("fp8", False):
        raise Fp8kitError(f"{where}: 'kv_cache' must be \"fp8\", or false for the source dtype (not {value!r})")
    if key == "lm_head" and not isinstance(value, bool):
        raise Fp8kitError(f"{where}: 'lm_head' must be true or false (not {value!r})")
    if key == "ignore" and not (isinstance(value, list) and all(isinstance(p, str) and p for p in value)):
        raise Fp8kitError(f"{where}: 'ignore' must be a list of regular expressions, e.g. ignore = [\"mlp.down_proj\"] "
                          f"(not {value!r})")


def read_plan(path: Path) -> dict:
    """The plan, every field checked here: a bad one is named with its file and [[model]] entry before any work."""
    from fp8kit.registry.catalog import tomllib

    try:
        plan = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise Fp8kitError(f"{path}: cannot read the plan ({e})") from e
    except RecursionError as e:  # tomllib recurses once per nesting level
        raise Fp8kitError(f"{path}: cannot read the plan (arrays or tables nested too deeply); a plan holds top-level "
                          f"settings and [[model]] tables") from e
    unknown = sorted(set(plan) - PLAN_TOP)
    if unknown:
        raise Fp8kitError(f"{path}: unknown top-level key {unknown[0]!r}; a plan has {', '.join(sorted(PLAN_TOP))}")
    for key in sorted(set(plan) - {"model"}):
        _check_plan_field(f"{path}: top level", key, plan[key])
    models = plan.get("model")
    if not isinstance(models, list) or not models:
        raise Fp8kitError(f"{path}: the plan needs [[model]] tables with src and schemes")
    for i, m in enumerate(models):
        where = f"{path}: [[model]] number {i + 1}"
        if not isinstance(m, dict) or "src" not in m or "schemes" not in m:
            raise Fp8kitError(f"{where} needs src and schemes")
        unknown = sorted(set(m) - PLAN_MODEL)
        if unknown:
            raise Fp8kitError(f"{where}: unknown key {unknown[0]!r}; a [[model]] has "
                              f"{', '.join(sorted(PLAN_MODEL))}")
        for key in sorted(m):
            _check_plan_field(where, key, m[key])
        if "base_model" not in m and Path(m["src"]).expanduser().is_dir():
            raise Fp8kitError(f"{where}: src {m['src']!r} is a local folder; add base_model = \"ORG/NAME\" (it names "
                              f"the source on the card)")
    return plan
