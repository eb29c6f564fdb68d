"""A Hugging Face Hub dataset named in ``data.train_files`` / ``data.test_files``.

    parse_hub_split("openai/gsm8k:main:test")      # HubSplit(repo, split='test', config='main')
    parse_hub_split("ORG/NAME", default_split="train")
    load_hub_rows(HubSplit(...))                   # the split's rows, as dicts

The form is ``ORG/NAME[@REVISION][[:CONFIG]:SPLIT]``: one colon names the split, two name the
configuration (a Hub dataset's subset) and the split. Without a split, the training files take
``train`` and the test files ``test``.

Rows are read through the ``datasets`` library, so its cache (``HF_DATASETS_CACHE``) and offline
switch (``HF_DATASETS_OFFLINE``, else ``HF_HUB_OFFLINE``) behave as in ``datasets.load_dataset``:
online, the data files come through the Hub cache (``HF_HOME``, ``HF_HUB_CACHE``) and are prepared
once into the datasets cache; offline, a dataset prepared before is read from there. A dataset
whose files are in the Hub cache but were never prepared (``hf download --repo-type dataset``)
is read offline from that snapshot.

Nothing from the Hub runs here: ``datasets`` (>= 4) has no dataset scripts, and only parquet, json
and arrow data are read; a repository of another kind (csv, images, a script) is refused with one
line naming it.
"""

from __future__ import annotations

import dataclasses
import re

HUB_SPLIT = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<revision>[\w./-]+?))?"
                       r"(:(?P<first>[\w.-]+))?(:(?P<second>[\w.-]+))?")
# the builders of data, never of code: what a Hub dataset may be read with here
DATA_BUILDERS = ("parquet", "json", "arrow", "cache")


@dataclasses.dataclass(frozen=True)
class HubSplit:
    """One split of a Hub dataset (``ORG/NAME[@REVISION][[:CONFIG]:SPLIT]``)."""

    repo: str
    split: str
    config: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return (f"{self.repo}{'@' + self.revision if self.revision else ''}"
                f"{':' + self.config if self.config else ''}:{self.split}")

    @property
    def set_name(self) -> str:
        """Its name in metrics and generation files: NAME[_CONFIG]_SPLIT."""
        return "_".join(p for p in (self.repo.split("/")[1], self.config, self.split) if p)


def parse_hub_split(spec: str, default_split: str = "train") -> HubSplit | None:
    """The Hub split ``spec`` names, or None when it is not of that form (a path)."""
    match = HUB_SPLIT.fullmatch(spec)
    if match is None:
        return None
    first, second = match["first"], match["second"]
    config, split = (first, second) if second else (None, first or default_split)
    return HubSplit(match["repo"], split, config, match["revision"] or None)


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _builder(path: str, hub: HubSplit, cache_dir: str | None):
    """``datasets``' builder of ``path`` (the Hub id, or its snapshot's folder), refused unless it
    reads data."""
    import datasets

    builder = datasets.load_dataset_builder(path, hub.config, revision=hub.revision if path == hub.repo else None,
                                            cache_dir=cache_dir)
    kind = type(builder).__module__.rsplit(".", 1)[-1]
    if kind not in DATA_BUILDERS:
        raise ValueError(f"a {kind} dataset; only {', '.join(DATA_BUILDERS[:3])} data are read here")
    return builder


def _snapshot(hub: HubSplit) -> str | None:
    """The dataset's files in the Hub cache (no network), or None when they are not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(hub.repo, repo_type="dataset", revision=hub.revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def load_hub_rows(hub: HubSplit, cache_dir: str | None = None) -> list[dict]:
    """The rows of ``hub``'s split (module docstring). FileNotFoundError when the dataset is neither
    in reach on the Hub nor in a cache here; ValueError for a split or configuration it lacks, or
    data of another kind."""
    try:
        try:
            builder = _builder(hub.repo, hub, cache_dir)
        except (ConnectionError, FileNotFoundError) as err:  # DatasetNotFoundError is a FileNotFoundError
            snapshot = _snapshot(hub)  # offline, and never prepared: the Hub cache's own copy of its files
            if snapshot is None:
                raise FileNotFoundError(f"{hub}: no such file or folder here, and no Hugging Face Hub dataset "
                                        f"{hub.repo} in reach or in the caches ({_reason(err)})") from None
            builder = _builder(snapshot, hub, cache_dir)
        builder.download_and_prepare()
    except FileNotFoundError as err:
        raise FileNotFoundError(str(err) if str(err).startswith(str(hub)) else f"{hub}: {_reason(err)}") from None
    except (ValueError, OSError) as err:
        raise ValueError(f"{hub}: {_reason(err)}") from None
    splits = list(builder.info.splits or {})
    if hub.split not in splits:
        raise ValueError(f"{hub}: the dataset has no split {hub.split!r} (it has {', '.join(splits) or 'none'})")
    return builder.as_dataset(split=hub.split).to_list()
