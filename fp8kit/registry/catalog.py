"""The catalog of pre-quantized FP8 uploads: the shipped file plus the user's overlay, validated on load.

Both are TOML lists of `[[variant]]` tables (see catalog.toml). Errors name the file and the line of
the offending entry, because people edit these files by hand.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from fp8kit.errors import Fp8kitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SHIPPED = Path(__file__).with_name("catalog.toml")
SCHEMES = ("dynamic", "block", "tensor", "torchao")
FORMATS = ("compressed-tensors", "fp8", "torchao")
FIELDS = {"repo_id": str, "family": str, "scheme": str, "format": str, "serves": list, "base": list}
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Variant:
    repo_id: str
    family: str
    scheme: str
    format: str
    serves: tuple[str, ...]
    base: tuple[str, ...]
    source: str  # "catalog" or "overlay"

    def to_dict(self) -> dict:
        return {"repo_id": self.repo_id, "family": self.family, "scheme": self.scheme, "format": self.format,
                "serves": list(self.serves), "base": list(self.base), "source": self.source}


def overlay_path() -> Path:
    if os.environ.get("FP8KIT_REGISTRY"):
        return Path(os.environ["FP8KIT_REGISTRY"]).expanduser()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "fp8kit" / "registry.toml"


VARIANT_HEADER = re.compile(r"""\[\[\s*(variant|"variant"|'variant')\s*\]\]\s*(#.*)?""")


def _entry_lines(text: str) -> list[int]:
    """The line of each [[variant]] header, also written `[[ "variant" ]]` or with tabs (valid TOML too)."""
    return [i + 1 for i, line in enumerate(text.splitlines()) if VARIANT_HEADER.fullmatch(line.strip())]


def _validate(raw: dict, path: Path, line: int, source: str) -> Variant:
    where = f"{path}:{line}"
    if not isinstance(raw, dict):
        raise Fp8kitError(f"{where}: each variant must be a [[variant]] table")
    for key, kind in FIELDS.items():
        if key not in raw:
            raise Fp8kitError(f"{where}: variant is missing '{key}'")
        if not isinstance(raw[key], kind):
            raise Fp8kitError(f"{where}: '{key}' must be a {kind.__name__}")
    unknown = set(raw) - set(FIELDS)
    if unknown:
        raise Fp8kitError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if not REPO_ID.match(raw["repo_id"]):
        raise Fp8kitError(f"{where}: repo_id {raw['repo_id']!r} is not of the form org/name")
    if raw["scheme"] not in SCHEMES:
        raise Fp8kitError(f"{where}: scheme {raw['scheme']!r} is not one of {', '.join(SCHEMES)}")
    if raw["format"] not in FORMATS:
        raise Fp8kitError(f"{where}: format {raw['format']!r} is not one of {', '.join(FORMATS)}")
    bad = [s for s in raw["serves"] if s not in SCHEMES]
    if bad or not raw["serves"]:
        raise Fp8kitError(f"{where}: serves must list schemes from {', '.join(SCHEMES)}")
    if not raw["base"] or not all(isinstance(b, str) and REPO_ID.match(b) for b in raw["base"]):
        raise Fp8kitError(f"{where}: base must list repo ids of the form org/name")
    return Variant(raw["repo_id"], raw["family"], raw["scheme"], raw["format"], tuple(raw["serves"]),
                   tuple(raw["base"]), source)


def read_file(path: Path, source: str) -> list[Variant]:
    try:
        text = path.read_text()
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise Fp8kitError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8 TOML") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Fp8kitError(f"{path}: not valid TOML: {e}") from e
    unknown = set(data) - {"variant"}
    if unknown:
        raise Fp8kitError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected [[variant]] tables")
    entries = data.get("variant", [])
    if not isinstance(entries, list):
        raise Fp8kitError(f"{path}: 'variant' must be written as [[variant]] tables")
    lines = _entry_lines(text)
    variants = []
    for i, raw in enumerate(entries):
        variants.append(_validate(raw, path, lines[i] if i < len(lines) else 1, source))
    return variants


def load(overlay: Path | None = None) -> list[Variant]:
    """Shipped catalog with the overlay merged over it: an overlay entry replaces the shipped entry of the
    same repo_id, and is consulted first."""
    shipped = read_file(SHIPPED, "catalog")
    path = overlay if overlay is not None else overlay_path()
    extra = read_file(path, "overlay") if path.exists() else []
    replaced = {v.repo_id.lower() for v in extra}
    return extra + [v for v in shipped if v.repo_id.lower() not in replaced]


def append_to_overlay(variant: Variant, path: Path | None = None) -> Path:
    """Publishing registers its uploads here; appending keeps the user's comments and layout."""
    path = path or overlay_path()
    read_file(path, "overlay") if path.exists() else None  # refuse to append to a broken file
    _validate({k: v for k, v in variant.to_dict().items() if k != "source"}, path, 0, "overlay")
    fields = {k: v for k, v in variant.to_dict().items() if k != "source"}
    block = "\n[[variant]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in fields.items())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot create its folder ({e.strerror}); set FP8KIT_REGISTRY to a writable "
                          f"file") from e
    _append_whole(path, block)
    return path


def _toml_value(value) -> str:
    """A TOML basic string (or a list of them): quotes, backslashes and control characters escaped."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + "".join({'"': '\\"', "\\": "\\\\"}.get(c) or (c if " " <= c != "\x7f" else f"\\u{ord(c):04x}")
                         for c in value) + '"'


def _append_whole(path: Path, block: str) -> None:
    """Rewrite `path` as its old text + `block` through a temporary file beside it and os.replace, under a lock file
    beside it: a failed write (disk full, interrupt) leaves the old file whole, and concurrent writers do not
    lose each other's entries. A symlinked file is rewritten at its target."""
    import secrets

    from filelock import FileLock

    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        with FileLock(target.with_name(f".{target.name}.lock")):
            text = target.read_text() if target.exists() else ""
            mode = target.stat().st_mode & 0o7777 if target.exists() else None
            try:
                with open(tmp, "x") as f:
                    f.write(text + block)
                    f.flush()
                    os.fsync(f.fileno())
                if mode is not None:
                    os.chmod(tmp, mode)
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot write the registry overlay ({e.strerror or e}); it was left as it "
                          f"was") from e
