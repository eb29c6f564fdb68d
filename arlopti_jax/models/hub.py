"""``model.path`` as a local folder or a Hugging Face Hub id.

    resolve("models/smollm2-135m")                 # a folder that is there: itself
    resolve("HuggingFaceTB/SmolLM2-135M-Instruct")  # a Hub id: its snapshot in the local Hub cache
    resolve("Qwen/Qwen2.5-3B-Instruct@main")        # ORG/NAME@REVISION: a branch, tag or commit

A Hub id goes through ``huggingface_hub.snapshot_download``, so its cache (``HF_HOME``,
``HF_HUB_CACHE``), ``HF_HUB_OFFLINE`` and tokens behave as in transformers: a snapshot already in the
cache is used without the network, and offline nothing else is tried. The processes of one host
download once: the first holds a lock beside the cache while the others wait for it. Only the files this
project reads are fetched (config, tokenizer, safetensors weights); no code from the Hub is run
(there is no ``trust_remote_code``) and no pickled weights are read. A path that is neither a
folder here nor a model the Hub (or, offline, its cache) has raises FileNotFoundError naming both.
"""

from __future__ import annotations

import re
from pathlib import Path

# what a model folder needs here: config.json, the tokenizer's files, the safetensors weights
SHAPE = ["*.json", "tokenizer*", "*.txt", "*.model", "*.jinja"]  # all but the weights (``aot``)
PATTERNS = SHAPE + ["*.safetensors"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def resolve(path: str, field: str = "config.model.path", weights: bool = True) -> Path:
    """The local folder of ``path``: the folder itself when it is one here, else the snapshot of the
    Hub id ``ORG/NAME[@REVISION]`` (downloaded into the Hub cache unless it is there; without its
    weights when ``weights`` is False)."""
    local = Path(path).expanduser()
    if local.is_dir() or not HUB_ID.fullmatch(path):
        return local
    repo, _, revision = path.partition("@")
    from filelock import FileLock
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # one download per host: the other processes of a multi-process run on this host wait for the
    # first and then find the snapshot in the cache
    lock = Path(constants.HF_HUB_CACHE) / f".arlopti-{repo.replace('/', '--')}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            return Path(snapshot_download(repo, revision=revision or None,
                                          allow_patterns=PATTERNS if weights else SHAPE))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"{field}={path}: no such folder here, and no Hugging Face Hub model {repo}"
                                f"{'@' + revision if revision else ''} in reach ({reason})") from None
