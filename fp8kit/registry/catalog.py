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
SCHEMES = ("dynamic", "block", "tensor", "tensor-static", "torchao")
FORMATS = ("compressed-tensors", "fp8", "torchao")
FIELDS = {"repo_id": str, "family": str, "scheme": str, "format": str, "serves": list, "base": list}
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# which formats hold which schemes (fp8's per-channel layout is not one vLLM reads), and what a variant may serve
SCHEME_FORMATS = {"dynamic": ("compressed-tensors",), "block": ("compressed-tensors", "fp8"),
                  "tensor": ("compressed-tensors", "fp8"), "tensor-static": ("compressed-tensors", "fp8"),
                  "torchao": ("torchao",)}


def is_repo_name(text) -> bool:
    """`org/name` as the Hub accepts it: huggingface_hub's own validator also refuses '..', '--' and over-long
    names, which a pattern alone lets through."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(text, str) or not REPO_ID.fullmatch(text):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


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


def _validate(raw: dict, where: str, source: str) -> Variant:
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
    if not is_repo_name(raw["repo_id"]):
        raise Fp8kitError(f"{where}: repo_id {raw['repo_id']!r} is not a Hub repo id of the form org/name")
    if raw["scheme"] not in SCHEMES:
        raise Fp8kitError(f"{where}: scheme {raw['scheme']!r} is not one of {', '.join(SCHEMES)}")
    if raw["format"] not in FORMATS:
        raise Fp8kitError(f"{where}: format {raw['format']!r} is not one of {', '.join(FORMATS)}")
    if raw["format"] not in SCHEME_FORMATS[raw["scheme"]]:
        raise Fp8kitError(f"{where}: format {raw['format']!r} does not hold scheme {raw['scheme']!r} (it is "
                          f"written as {' or '.join(SCHEME_FORMATS[raw['scheme']])})")
    bad = [s for s in raw["serves"] if s not in SCHEMES]
    if bad or not raw["serves"]:
        raise Fp8kitError(f"{where}: serves must list schemes from {', '.join(SCHEMES)}")
    # a variant answers its own scheme; a block or tensor upload may also answer "dynamic" (Qwen's block uploads
    # do), but no FP8 upload answers torchao or a finer scheme than its own, and a tensor-static one nothing else:
    # the GRPO runtime, which asks for dynamic, refuses static activation scales
    allowed = ({raw["scheme"]} if raw["scheme"] in ("torchao", "tensor-static") else {raw["scheme"], "dynamic"})
    if raw["scheme"] not in raw["serves"] or not set(raw["serves"]) <= allowed:
        raise Fp8kitError(f"{where}: serves {raw['serves']!r} does not fit scheme {raw['scheme']!r}; list "
                          f"{raw['scheme']!r} and at most {' and '.join(sorted(allowed - {raw['scheme']})) or 'nothing else'}")
    if not raw["base"] or not all(is_repo_name(b) for b in raw["base"]):
        raise Fp8kitError(f"{where}: base must list Hub repo ids of the form org/name")
    return Variant(raw["repo_id"], raw["family"], raw["scheme"], raw["format"], tuple(raw["serves"]),
                   tuple(raw["base"]), source)


def read_file(path: Path, source: str) -> list[Variant]:
    try:
        text = path.read_text(encoding="utf-8")  # not the locale's: TOML is UTF-8
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise Fp8kitError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8 TOML") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Fp8kitError(f"{path}: not valid TOML: {e}") from e
    except RecursionError as e:  # tomllib recurses once per nesting level
        raise Fp8kitError(f"{path}: arrays or tables nested too deeply to read; an overlay holds [[variant]] tables of "
                          f"strings and lists of strings") from e
    unknown = set(data) - {"variant"}
    if unknown:
        raise Fp8kitError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected [[variant]] tables")
    entries = data.get("variant", [])
    if not isinstance(entries, list):
        raise Fp8kitError(f"{path}: 'variant' must be written as [[variant]] tables")
    lines = _entry_lines(text)
    variants, seen = [], {}
    for i, raw in enumerate(entries):
        # [[variant]] headers give lines; an inline array (variant = [{...}, {...}]) has none to count
        where = f"{path}:{lines[i]}" if len(lines) == len(entries) else f"{path}: variant {i + 1}"
        variant = _validate(raw, where, source)
        # two entries of one repo: resolve answered with the first, publish's checks read the last
        first = seen.setdefault(variant.repo_id.lower(), where)
        if first != where:
            raise Fp8kitError(f"{where}: {variant.repo_id} is listed already ({first}); keep one entry for it")
        variants.append(variant)
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
    _validate({k: v for k, v in variant.to_dict().items() if k != "source"}, f"{path}: new variant", "overlay")
    fields = {k: v for k, v in variant.to_dict().items() if k != "source"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot create its folder ({e.strerror}); set FP8KIT_REGISTRY to a writable "
                          f"file") from e
    _append_whole(path, fields)
    return path


def _with_entry(text: str, fields: dict, path: Path) -> str:
    """`text` with one more entry, last (earlier entries keep their precedence), in the file's own form: a [[variant]]
    table after the others, or, in an inline `variant = [...]` array (after which TOML allows no [[variant]] table),
    an inline table before its closing bracket. Where that bracket is cannot be told without parsing, so each place
    is tried and parsed back: a text is kept only when it reads as the old entries and this one, so a bracket in a
    string or a comment is never taken for it and a file is never written that every registry command would refuse."""
    old = tomllib.loads(text)
    # checked here, under the overlay's lock: two publish runs of one repo each saw it unlisted, and the file they left
    # (the repo listed twice) was refused by every registry command
    listed = next((e for e in old.get("variant", []) if isinstance(e, dict)
                   and str(e.get("repo_id", "")).lower() == fields["repo_id"].lower()), None)
    if listed is not None and {**listed, "repo_id": ""} == {**fields, "repo_id": ""}:  # the same entry (any case)
        return text
    if listed is not None:
        raise Fp8kitError(f"{path}: lists {listed.get('repo_id')} already, as {listed.get('scheme')} "
                          f"({listed.get('format')}) of {', '.join(map(str, listed.get('base', [])))}; remove that "
                          f"entry first to register it again")
    want = {**old, "variant": [*old.get("variant", []), fields]}
    table = "\n[[variant]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in fields.items())
    inline = "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in fields.items()) + " }"

    def candidates():
        yield text + table
        for i in reversed([m.start() for m in re.finditer(r"]", text)]):
            j = len(text[:i].rstrip())  # just after what precedes the bracket: an entry, a comma, `[` or a comment
            lines = "\n" in text[j:i]
            yield text[:j] + (",\n  " if lines else ", ") + inline + text[j:]  # after an entry
            yield text[:j] + ("\n  " if lines else " ") + inline + "," + text[j:]  # after a comma or `[`
            yield text[:i] + ", " + inline + "\n" + text[i:]  # after an entry and a comment

    for candidate in candidates():
        try:
            if tomllib.loads(candidate) == want:
                return candidate
        except (tomllib.TOMLDecodeError, RecursionError):
            pass
    raise Fp8kitError(f"{path}: cannot add {fields['repo_id']} to this overlay; write its entries as [[variant]] "
                      f"tables, then register it again")


def _toml_value(value) -> str:
    """A TOML basic string (or a list of them): quotes, backslashes and control characters escaped."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + "".join({'"': '\\"', "\\": "\\\\"}.get(c) or (c if " " <= c != "\x7f" else f"\\u{ord(c):04x}")
                         for c in value) + '"'


def _append_whole(path: Path, fields: dict) -> None:
    """Rewrite `path` as its old text with the entry `fields` added (_with_entry) through a temporary file beside it
    and os.replace, under a lock file beside it: a failed write (disk full, interrupt) leaves the old file whole, and
    concurrent writers do not lose each other's entries. A symlinked file is rewritten at its target."""
    import secrets

    from filelock import FileLock

    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        with FileLock(target.with_name(f".{target.name}.lock")):
            text = _with_entry(target.read_text(encoding="utf-8") if target.exists() else "", fields, path)
            mode = target.stat().st_mode & 0o7777 if target.exists() else None
            try:
                with open(tmp, "x", encoding="utf-8") as f:
                    f.write(text)
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
