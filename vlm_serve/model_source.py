"""Where a model's files are: a local checkpoint folder, a Hugging Face model id (found in, or downloaded
into, huggingface_hub's cache: only the files serving reads), or the built-in model.

Every command resolves its `--model` here before anything starts, so that a wrong one is one line naming
it, in `serve` with any number of ranks as in `generate`.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.config import ModelSettings

# what serving reads: config and processor JSON files, weights, the tokenizer (merges.txt), chat templates
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
S = TypeVar("S", bound=ModelSettings)  # ServerArgs, or the model's settings alone


def resolve_model(
    model: str | Path | None, revision: str | None = None, download_dir: str | None = None, weights: bool = True
) -> Path:
    """The local folder holding the checkpoint `model` names (None: the built-in one). A ValueError of
    one line naming `model` if there is none. Without `weights`, a folder without weights will do."""
    if model is None:
        return BUILTIN_MODEL
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(str(model)):
        path = _from_hub(str(model), revision, download_dir)
    elif not path.exists():
        raise ValueError(f"model {model}: no such folder")
    return check_checkpoint(path, weights)


def with_local_model(server_args: S) -> S:
    """`server_args` with `model` the local checkpoint folder it names (`resolve_model`), served under
    its Hugging Face id as given (as vLLM does) or else the folder's name, unless a name is set."""
    model = server_args.model
    folder = resolve_model(model, server_args.revision, server_args.download_dir, server_args.load_format != "dummy")
    from_hub = model is not None and folder != Path(model).expanduser()
    served = server_args.served_model_name or (model if from_hub else folder.name)
    return replace(server_args, model=str(folder), served_model_name=served)


def is_hub_id(model: str) -> bool:
    """Whether `model` has the form of a Hugging Face model id, `owner/name`."""
    return _HUB_ID.fullmatch(model) is not None and ".." not in model


def check_checkpoint(path: Path, weights: bool = True) -> Path:
    """`path`, if it is a Hugging Face checkpoint folder (config.json and, if `weights`, safetensors weights)."""
    if not path.is_dir():
        raise ValueError(f"model {path}: not a folder (a checkpoint folder holds config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {path}: no config.json in it (not a Hugging Face checkpoint folder)")
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"model {path}: no *.safetensors weights in it")
    return path


def _from_hub(repo_id: str, revision: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # read here, not at huggingface_hub's import: a process may set it after importing transformers
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=HUB_FILES, local_files_only=offline
        )
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id}: no such folder, nor a model on the Hugging Face Hub you can read") from None
    except LocalEntryNotFoundError:
        where = f"in {cache_dir}" if cache_dir else "in the Hugging Face cache"
        why = "HF_HUB_OFFLINE is set" if offline else "and the Hub cannot be reached"
        at = "" if revision is None else f" at revision {revision!r}"
        raise ValueError(f"model {repo_id}: no such folder, nor{at} {where} ({why})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"model {repo_id}: could not download it from the Hugging Face Hub: {exc}") from None
    return Path(folder)
