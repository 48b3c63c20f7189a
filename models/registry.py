"""Model sources: `embedded:<name>`, a local Hugging Face-layout folder, or a hub repo id.

`resolve()` turns any of them into a local folder that mlx-lm's loader reads unchanged, or raises
`ModelSourceError` with one sentence that says what is wrong and what to do instead.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent
EMBEDDED_PREFIX = "embedded:"
DEFAULT_SOURCE = "embedded:tiny-qwen3.5"
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a checkpoint needs to load and chat; weights of other formats are never fetched.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.md"]


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message says why and what to pass instead."""


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # what the user asked for
    path: Path  # local folder in Hugging Face layout
    kind: str  # "embedded", "local" or "hub"
    model_type: str
    quantized: bool  # already an MLX quantized checkpoint (has a "quantization" entry)

    @property
    def name(self) -> str:
        if self.kind == "embedded":
            return self.source[len(EMBEDDED_PREFIX):]
        if self.kind == "hub":
            return self.source
        return self.path.name


def embedded_names() -> list[str]:
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def read_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelSourceError(f"{folder} has no config.json; a model folder must be in Hugging "
                               "Face layout (config.json, *.safetensors, tokenizer files)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{cfg_path} is not valid JSON ({exc}); the checkpoint is "
                               "damaged, fetch or copy it again") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelSourceError(f"{cfg_path} has no \"model_type\"; it is not a transformers "
                               "model config")
    return config


def check_folder(folder: Path) -> dict:
    """Checks that `folder` holds a loadable checkpoint; returns its config."""
    config = read_config(folder)
    model_type = config["model_type"]
    try:
        importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise ModelSourceError(f"{folder}: model_type '{model_type}' is not supported by the "
                               "installed mlx-lm; mixbit serves the qwen3_5 family (qwen3_5, "
                               "qwen3_5_moe) and whatever else mlx-lm can load") from None
    if not any(folder.glob("*.safetensors")):
        raise ModelSourceError(f"{folder} has no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ModelSourceError(f"{folder} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return config


def _resolved(source: str, folder: Path, kind: str) -> ResolvedModel:
    config = check_folder(folder)
    return ResolvedModel(source=source, path=folder, kind=kind, model_type=config["model_type"],
                         quantized="quantization" in config)


def _from_hub(repo_id: str, revision: str, cache_dir: str | None, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    kwargs = dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=HUB_PATTERNS)
    try:
        return Path(snapshot_download(local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hint = (f"download it on a machine with network access (e.g. `hf download {repo_id} "
            f"--local-dir DIR`), copy DIR here and pass `--model DIR`")
    if offline or not allow_download:
        why = "HF_HUB_OFFLINE is set" if offline else "model.allow_download is false"
        raise ModelSourceError(f"hub model {repo_id}@{revision} is not in the local cache and "
                               f"{why}; {hint}")
    try:
        return Path(snapshot_download(**kwargs))
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelSourceError(f"hub repository {repo_id} does not exist or needs access rights "
                               "(set HF_TOKEN); check the id") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"hub repository {repo_id} has no revision '{revision}'") from None
    except Exception as exc:  # connection refused, DNS failure, timeouts, proxies
        raise ModelSourceError(f"cannot reach the Hugging Face hub to fetch {repo_id} "
                               f"({type(exc).__name__}); {hint}") from None


def resolve(source: str = DEFAULT_SOURCE, revision: str = "main", hub_cache_dir: str | None = None,
            allow_download: bool = True) -> ResolvedModel:
    """`hub_cache_dir` None: the Hugging Face default cache (HF_HOME / HF_HUB_CACHE apply)."""
    source = source.strip()
    if source.startswith(EMBEDDED_PREFIX):
        name = source[len(EMBEDDED_PREFIX):]
        folder = EMBEDDED_DIR / name
        if name not in embedded_names():
            raise ModelSourceError(f"no embedded model named '{name}'; embedded models: "
                                   f"{', '.join(embedded_names()) or 'none'}")
        return _resolved(source, folder, "embedded")
    path = Path(source).expanduser()
    if path.is_dir():
        return _resolved(source, path.resolve(), "local")
    if path.exists():
        raise ModelSourceError(f"{path} is a file; pass the folder that holds config.json")
    if HUB_ID.match(source):
        cache = str(Path(hub_cache_dir).expanduser()) if hub_cache_dir else None
        return _resolved(source, _from_hub(source, revision, cache, allow_download), "hub")
    raise ModelSourceError(f"model source '{source}' is not embedded:<name>, an existing folder, "
                           "or a hub repo id (owner/name)")
