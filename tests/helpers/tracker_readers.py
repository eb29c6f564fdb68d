"""Reading back what a run logged to its trackers, with the trackers' own formats and clients:
W&B's offline transaction log (``run-<id>.wandb``: LevelDB-log framing, records in wandb's own
protobuf ``wandb_internal_pb2.Record``; wandb ships no Python reader of it) and an MLflow store
through ``mlflow.MlflowClient``; TensorBoard through ``arlopti_jax.plot.read_scalars``. Also the
environment that keeps W&B offline and MLflow on a local file store inside a test's folder."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768  # the LevelDB log's block
HEADER = b":W&B\xe1\xbe\x00"  # wandb's log header: ident, magic 0xBEE1, version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_env(folder: Path, monkeypatch) -> str:
    """W&B offline with its config, cache and data folders (and no key) under ``folder``; MLflow's
    file store at ``folder/mlruns``, experiment 'arlopti-test'. Returns the MLflow tracking URI."""
    uri = f"file:{folder / 'mlruns'}"
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": folder / "wandb_config",
                        "WANDB_CACHE_DIR": folder / "wandb_cache", "WANDB_DATA_DIR": folder / "wandb_data",
                        "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true",
                        "MLFLOW_EXPERIMENT_NAME": "arlopti-test"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return uri


def wandb_records(path: Path) -> list:
    """Every record of a .wandb transaction log, each record's checksum checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a W&B transaction log"
    pos, records, pending = len(HEADER), [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert crc == zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF, f"{path}: bad checksum at byte {pos}"
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
        pos += 7 + length
    return records


def _items(items) -> dict:
    """History items or summary updates -> a dict (nested keys joined into nested dicts)."""
    out: dict = {}
    for item in items:
        keys = list(item.nested_key) or [item.key]
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out


def wandb_logs(run_dir: Path) -> list[Path]:
    """The offline W&B runs' transaction logs under ``run_dir/wandb``, oldest first (a resumed run adds
    one, with the same run id: ``run-<id>.wandb``)."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def read_wandb(run_dir: Path, log: Path | None = None) -> dict:
    """The one offline W&B run under ``run_dir/wandb`` (or its transaction log ``log``): its id,
    config, history rows by step (tables read from their files as lists of rows), and final summary."""
    if log is None:
        [log] = wandb_logs(run_dir)
    records = wandb_records(log)
    config, history, summary, name, run_id = {}, {}, {}, None, None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
            name, run_id = record.run.display_name, record.run.run_id
        elif kind == "history":
            row = _items(record.history.item)
            for key, value in list(row.items()):
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    row[key] = json.loads((log.parent / "files" / value["path"]).read_text())["data"]
            history.setdefault(int(row["_step"]), {}).update(row)
        elif kind == "summary":
            summary.update(_items(record.summary.update))
    return {"config": config, "history": history, "summary": summary, "name": name, "id": run_id}


def read_mlflow(uri: str, experiment: str = "arlopti-test") -> dict:
    """The one run of ``experiment`` in the store at ``uri``: params, each metric's (step, value)
    history, the text artifacts, its name and status."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    run_id = run.info.run_id

    def files(path=None):
        for entry in client.list_artifacts(run_id, path):
            yield from files(entry.path) if entry.is_dir else [entry.path]

    texts = {p: Path(client.download_artifacts(run_id, p)).read_text() for p in files()}
    return {"params": run.data.params, "status": run.info.status, "name": run.info.run_name, "tags": run.data.tags,
            "id": run_id,
            "metrics": {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
                        for k in run.data.metrics}, "texts": texts}
