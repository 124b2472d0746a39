"""Find a checkpoint's files: a local directory, or a Hub repo id fetched into the normal HF cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fp8kit.converter.safetensors_io import TensorInfo, read_header
from fp8kit.errors import Fp8kitError

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", ".msgpack", ".h5", ".gguf") + PICKLE_SUFFIXES
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
# Everything a model repo holds that is not a weight file; weights other than safetensors never download.
HUB_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.md", "LICENSE*",
                "*.yaml", "*.vocab", "*merges*"]
# Weights transformers does not load, which weight_files() never reads: Mistral's consolidated.safetensors (another
# copy in Mistral's own names, as large as the model), a subfolder's (original/, an adapter's) and a LoRA adapter's.
# ("*" spans "/" in huggingface_hub's patterns.)
HUB_IGNORED = ["consolidated*.safetensors", "*/*.safetensors", "adapter_model*.safetensors"]


def is_repo_id(text: str) -> bool:
    """`org/name[@revision]`, and not a path spelled like one."""
    return bool(REPO_ID.fullmatch(text)) and not text.startswith((".", "/", "~"))


def resolve(src: str | Path) -> Path:
    """A local directory as is; `org/name[@revision]` through huggingface_hub (HF_HUB_OFFLINE=1 uses the cache)."""
    if not str(src).strip():  # Path("") is the current folder
        raise Fp8kitError("an empty SRC: give a checkpoint folder or a Hub repo id org/name[@revision]")
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise Fp8kitError(f"{path}: SRC must be a checkpoint directory (with config.json and *.safetensors)")
        return path
    text = str(src)
    if not is_repo_id(text):
        raise Fp8kitError(f"{src}: no such directory, and not a Hub repo id of the form org/name[@revision]")
    repo_id, _, revision = text.partition("@")
    # models/llama mistyped reads as a repo id; where its first folder exists here, the errors say it meant a path
    nor_folder = f" (nor a folder: {path.resolve()} does not exist)" if path.parent.is_dir() else ""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if constants.HF_HUB_OFFLINE:  # the cache knows a short commit hash only by its snapshot's folder
        revision = snapshot_commit(repo_id, revision) or revision
    try:
        # Offline, a commit-hash revision must also be looked up in the cache only (huggingface_hub would
        # otherwise try to list the commit's files online).
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_PATTERNS,
                                      ignore_patterns=HUB_IGNORED, local_files_only=constants.HF_HUB_OFFLINE))
    except GatedRepoError as e:
        raise Fp8kitError(f"{repo_id}: gated repo; accept its terms on the Hub and log in (hf auth login)") from e
    except RepositoryNotFoundError as e:
        raise Fp8kitError(f"{repo_id}: repo not found on the Hub (or private: log in with hf auth login)"
                          f"{nor_folder}") from e
    except RevisionNotFoundError as e:
        raise Fp8kitError(f"{repo_id}: revision {revision!r} not found on the Hub") from e
    except LocalEntryNotFoundError as e:
        raise Fp8kitError(f"{repo_id}: not in the local HF cache and the Hub cannot be reached (HF_HUB_OFFLINE set, "
                          f"or no network){nor_folder}; download it first or unset HF_HUB_OFFLINE") from e
    except HFValidationError as e:  # names the regex admits but the Hub does not (a--b, .git, over 96 characters)
        raise Fp8kitError(f"{text}: not a valid Hub repo id ({str(e).splitlines()[0]})") from e
    except (OSError, _network_error()) as e:
        raise Fp8kitError(f"{repo_id}: download failed ({e.__class__.__name__}); check the network or use a local copy") from e


def snapshot_commit(repo_id: str, revision: str) -> str | None:
    """The full commit of a short commit hash (7 to 39 hex digits) whose snapshot is in the HF cache, if exactly one
    is: offline, huggingface_hub looks a revision up among its refs (branch names) or as a full hash only."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not re.fullmatch(r"[0-9a-f]{7,39}", revision) or not snapshots.is_dir():
        return None
    found = [p.name for p in snapshots.iterdir() if p.name.startswith(revision)]
    return found[0] if len(found) == 1 else None


def _network_error() -> type[Exception]:
    """huggingface_hub 1.x downloads with httpx, whose errors are not OSErrors; 0.x with requests, whose are."""
    try:
        from httpx import HTTPError
    except ImportError:
        return OSError
    return HTTPError


def load_config(src: Path) -> dict:
    path = src / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise Fp8kitError(f"{path}: missing; SRC must be a Hugging Face checkpoint directory") from e
    except RecursionError as e:  # [[[...]]] nested deeper than Python's parser goes
        raise Fp8kitError(f"{path}: not a usable config (JSON nested too deeply); re-download it") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Fp8kitError(f"{path}: unreadable or not JSON ({e})") from e
    if not isinstance(config, dict):
        raise Fp8kitError(f"{path}: not a JSON object")
    for key in ("quantization_config", "compression_config"):
        if key in config:
            method = config[key].get("quant_method", "unknown") if isinstance(config[key], dict) else "unknown"
            raise Fp8kitError(f"{path}: checkpoint is already quantized (quant_method {method}); convert the original "
                              f"BF16/FP16/FP32 checkpoint instead")
    return config


def read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except RecursionError as e:  # [[[...]]] nested deeper than Python's parser goes
        raise Fp8kitError(f"{index}: not a usable index (JSON nested too deeply); re-download it") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise Fp8kitError(f"{index}: unreadable or has no weight_map; re-download it") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise Fp8kitError(f"{index}: weight_map must map tensor names to shard file names; re-download it")
    if not weight_map:
        raise Fp8kitError(f"{index}: weight_map is empty, so the index names no weights; re-download the checkpoint")
    return weight_map


def follows_index(src: Path) -> bool:
    """Whether transformers loads the index's shards: there is an index and no model.safetensors, which it reads first
    (save_pretrained re-saving a sharded model as one file leaves the old index behind)."""
    return (src / INDEX_NAME).exists() and not (src / "model.safetensors").is_file()


def weight_files(src: Path) -> list[Path]:
    """The files transformers loads: the index's shards (follows_index), else model.safetensors alone, else every
    *.safetensors."""
    index = src / INDEX_NAME
    if follows_index(src):
        weight_map = read_weight_map(index)
        for name in sorted(set(weight_map.values())):
            # the name, not where it links: the HF cache's snapshot files are symlinks into ../../blobs
            if Path(name).name != name or name in (".", ".."):
                raise Fp8kitError(f"{index}: names shard {name!r} outside the checkpoint directory")
        files = sorted({src / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise Fp8kitError(f"{index}: names shard {f.name}, which is missing; re-download the checkpoint")
        return files
    if (src / "model.safetensors").is_file():  # a LoRA adapter's adapter_model.safetensors beside it is not the model's
        return [src / "model.safetensors"]
    files = sorted(p for p in src.glob("*.safetensors") if p.is_file())
    if len(files) > 1:  # Mistral repos hold consolidated.safetensors beside the HF-format shards
        files = [p for p in files if not p.name.startswith("consolidated")] or files
    if not files:
        pickles = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise Fp8kitError(f"{src}: only pickle weights ({', '.join(pickles[:3])}); fp8-convert never unpickles "
                              f"model files: save the model as safetensors first (save_pretrained(safe_serialization=True))")
        raise Fp8kitError(f"{src}: no *.safetensors weights found")
    return files


def read_tensors(src: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint by name, its headers checked against the file sizes."""
    tensors: dict[str, TensorInfo] = {}
    for path in weight_files(src):
        found, _ = read_header(path)
        for name, info in found.items():
            if name in tensors:
                raise Fp8kitError(f"{path}: tensor {name!r} also appears in {tensors[name].path.name}")
            tensors[name] = info
    index = src / INDEX_NAME
    if follows_index(src):
        for name, shard in read_weight_map(index).items():
            info = tensors.get(name)
            if info is None or info.path.name != Path(shard).name:
                raise Fp8kitError(f"{index}: names tensor {name!r} in {shard}, which does not contain it; "
                                  f"re-download the checkpoint")
    return tensors


def is_weight_file(path: Path) -> bool:
    return path.name == INDEX_NAME or path.suffix in WEIGHT_SUFFIXES or path.name.endswith(".safetensors.index.json")


CHAT_TEMPLATES_DIR = "additional_chat_templates"  # where transformers saves a tokenizer's named chat templates
NOT_COPIED = ("config.json", "adapter_config.json")  # rewritten; a PEFT adapter's, whose weights are not carried


def extra_files(src: Path) -> list[Path]:
    """Tokenizer, generation config, chat templates, license, processor configs...: copied as they are. Paths
    relative to `src`."""
    def wanted(p: Path) -> bool:
        return p.is_file() and not p.name.startswith(".") and p.name not in NOT_COPIED and not is_weight_file(p)

    templates = src / CHAT_TEMPLATES_DIR
    return sorted([Path(p.name) for p in src.iterdir() if wanted(p)]
                  + ([Path(CHAT_TEMPLATES_DIR, p.name) for p in templates.iterdir() if wanted(p)]
                     if templates.is_dir() else []))


def copy_extra_files(src: Path, dst: Path, keep_existing: bool = False) -> None:
    """extra_files(src) copied into `dst`; a file SRC does not let us read is named as such (not as a failure to
    write OUT)."""
    import shutil

    for rel in extra_files(src):
        target = dst / rel
        if keep_existing and target.exists():
            continue
        try:
            reader = open(src / rel, "rb")
        except OSError as e:
            raise Fp8kitError(f"{src / rel}: cannot read ({e.strerror or e}); make it readable, or move it out of "
                              f"SRC") from e
        target.parent.mkdir(exist_ok=True)
        with reader, open(target, "wb") as writer:
            shutil.copyfileobj(reader, writer)


def folder_files(folder: Path) -> list[str]:
    """Every regular file under `folder`, as sorted relative POSIX paths (chat templates live in a subfolder)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def check_against_config(src: Path, tensors: dict[str, TensorInfo]) -> None:
    """transformers builds the model from config.json and fills it by name: a Linear or embedding weight the
    checkpoint lacks is initialised at random (and calibrated and written as if it were the model's), and one of
    another shape fails vLLM's load. Both are refused here, from the model built on the meta device (no weight is
    read). Architectures transformers cannot build, and fused MoE experts (3-D tensors a converter makes from
    per-expert ones, no Linear), are left to the engines."""
    import torch
    from huggingface_hub.errors import StrictDataclassError

    from fp8kit.loaded_names import key_renamer, meta_model

    try:
        model = meta_model(src)
        rename = key_renamer(model)
    except StrictDataclassError as e:  # a field of the wrong type: transformers and vLLM refuse to load the config
        why = " ".join(line.strip() for line in str(e).strip().splitlines()[:2])
        raise Fp8kitError(f"{src / 'config.json'}: transformers refuses it ({why}); fix that field") from e
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build here: nothing to check against
        return
    held = {rename(name): info for name, info in tensors.items()}
    weights = {f"{n}.weight": m.weight for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and isinstance(m.weight, torch.nn.Parameter)}
    for name, weight in weights.items():
        info = held.get(name)
        if info is not None and tuple(info.shape) != tuple(weight.shape):
            raise Fp8kitError(f"{info.path}: {info.name} has shape {list(info.shape)}, but config.json gives the "
                              f"model {list(weight.shape)}: the weights and config.json do not belong together; fix "
                              f"config.json or the weights")
    present = {id(w) for name, w in weights.items() if name in held}  # a tied head shares the embeddings' tensor
    missing = [name for name, w in weights.items() if name not in held and id(w) not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise Fp8kitError(f"{src}: lacks {missing[0]}{more}, which config.json gives the model (transformers would "
                          f"fill them at random): the weights and config.json do not belong together; add the "
                          f"missing weights (a shard left out of the index?) or fix config.json")
