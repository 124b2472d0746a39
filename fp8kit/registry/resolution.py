"""Base model name + requested scheme -> a pre-quantized upload, or the conversion that will be run.

Identity, never similarity: a name matches a variant only if it is the variant's repo id or one of its
listed base names (case-insensitively). A wrong answer, another model's weights, is worse than a
conversion.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass

from fp8kit.registry import catalog
from fp8kit.registry.catalog import Variant

# tensor-static: per-tensor weights with static activation scales, calibrated on the shipped sample when converted
REQUESTS = ("auto", "dynamic", "block", "tensor", "tensor-static")


@dataclass(frozen=True)
class Resolution:
    name: str
    scheme: str  # the scheme the request resolved to (auto decided for this machine)
    repo_id: str | None  # the upload to use, or None when a conversion is needed
    format: str
    source: str  # catalog | overlay | convert
    family: str | None = None
    variant_scheme: str | None = None  # how the upload is quantized (Qwen's block uploads serve dynamic too)
    convert_command: str | None = None  # None when the conversion is cached already
    model_dir: str | None = None  # the model's cache folder: one folder per source commit
    cache_dir: str | None = None  # where the conversion is or will be cached; None while the commit is not known
    cached: bool = False  # the conversion is in the cache, complete

    def to_dict(self) -> dict:
        return asdict(self)


def has_rowwise_fp8() -> bool:
    """Row-wise (per-channel) FP8 GEMMs need SM89+ (Ada, Hopper, Blackwell)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def resolve_scheme(scheme: str) -> str:
    if scheme not in REQUESTS:
        from fp8kit.errors import Fp8kitError

        raise Fp8kitError(f"--scheme {scheme!r}: expected one of {', '.join(REQUESTS)}")
    if scheme == "auto":
        return "dynamic" if has_rowwise_fp8() else "block"
    return scheme


def _answer(name: str, scheme: str, variant: Variant) -> Resolution:
    return Resolution(name=name, scheme=scheme, repo_id=variant.repo_id, format=variant.format,
                      source=variant.source, family=variant.family, variant_scheme=variant.scheme)


def resolve(name: str, scheme: str = "auto", variants: list[Variant] | None = None) -> Resolution:
    from fp8kit.registry.cache import _legacy_model_dir, _usable_root, known_commit, model_dir, verify

    from pathlib import Path

    from fp8kit.converter.source import is_repo_id
    from fp8kit.errors import Fp8kitError

    scheme = resolve_scheme(scheme)
    if not name.strip():  # Path("") is the current folder: an unset $MODEL converted whatever folder one was in
        raise Fp8kitError("an empty model name: give a Hub repo id org/name[@revision] or a checkpoint folder")
    variants = catalog.load() if variants is None else variants
    if not Path(name).expanduser().is_dir():
        # a pasted name's stray spaces go everywhere it is used: the folder test, matching, the command, the cache
        name = name.strip()
    local = Path(name).expanduser().is_dir()
    if local:  # a local checkpoint is converted, whatever its path looks like
        variants = []
        from fp8kit.converter import source

        # what fp8-convert refuses at once (no config.json, already quantized, pickle weights only) is said now, not
        # planned as a conversion to run
        source.load_config(Path(name).expanduser())
        source.weight_files(Path(name).expanduser())
    else:
        if not is_repo_id(name):
            raise Fp8kitError(f"{name}: no such folder, and not a Hub repo id of the form org/name[@revision]")
        repo_id = name.partition("@")[0]
        if not catalog.is_repo_name(repo_id):  # '..', '--', '.git', over 96 characters: the Hub refuses them
            raise Fp8kitError(f"{name}: not a valid Hub repo id (huggingface_hub refuses the name {repo_id!r}); check "
                              f"its spelling")
    base, _, revision = name.partition("@")
    key = base.lower()
    for v in variants:
        if v.repo_id.lower() == key:  # already a variant, pinned or not: it is its own answer
            answer = _answer(v.repo_id, v.scheme if v.scheme in REQUESTS else scheme, v)
            if revision:  # the pin kept, as the caller spelled it (commit hashes and branch names are case-exact)
                pinned = f"{v.repo_id}@{revision}"
                answer = Resolution(**{**answer.to_dict(), "name": pinned, "repo_id": pinned})
            return answer
    # a pinned base revision is converted: an upload was made from some commit of the base, not necessarily that one
    matches = [] if revision else [v for v in variants if key in (b.lower() for b in v.base)]
    for v in matches:
        if scheme in v.serves:
            return _answer(name, scheme, v)
    # where cached_conversion() writes: model_dir(name) / the source's commit / entry_name
    _usable_root("nothing was converted")  # its command would convert into a subfolder of that file
    commit = known_commit(name)
    cache = model_dir(name) / commit / entry_name(scheme) if commit else None
    cached = cache is not None and verify(cache)
    legacy = _legacy_model_dir(name)  # earlier fp8kit's pinned layout: ensure() moves such an entry and reuses it
    if cache is not None and not cached and legacy is not None and verify(legacy / commit / entry_name(scheme)):
        cache, cached = legacy / commit / entry_name(scheme), True
    if local and scheme == "tensor-static" and not cached:
        # it calibrates on text: without a tokenizer that loads, the conversion could only fail
        from fp8kit.converter.calibration import calibration_tokenizer

        calibration_tokenizer(Path(name).expanduser(), "--scheme tensor-static")
    if cached:  # fp8-convert would refuse an existing OUT: there is nothing to run
        command = None
    elif commit:  # an entry that fails verify() (a file changed or missing) is replaced, as ensure() would
        # a Hub name is pinned to the commit that names OUT: online, fp8-convert would fetch the branch's newest
        # commit, and refuse to convert it into the folder of the one the HF cache last recorded
        pinned = name if local else f"{base}@{commit}"
        command = shlex.join(["fp8-convert", pinned, str(cache), "--scheme", scheme]
                             + (["--overwrite"] if cache.exists() else []))
    else:  # OUT is named by a commit not known yet: ensure() fetches it, then converts into its folder and records it
        command = shlex.join(["python", "-c", f"from fp8kit.registry import ensure; "
                                              f"print(ensure({json.dumps(name)}, {json.dumps(scheme)}))"])
    return Resolution(name=name, scheme=scheme, repo_id=None, format="compressed-tensors", source="convert",
                      family=matches[0].family if matches else None, convert_command=command,
                      model_dir=str(model_dir(name)), cache_dir=str(cache) if cache else None, cached=cached)


def entry_name(scheme: str, fmt: str = "compressed-tensors") -> str:
    from fp8kit import __version__

    return f"{scheme}-{fmt}-fp8kit{__version__}"
