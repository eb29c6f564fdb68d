"""Copy a matched sweep's records (not its checkpoints) from its folder into this one.

    python docs/matched_smollm2/sync.py OUT

For the grid (OUT/grid) and the comparison (OUT): results.json, and each finished run's
metrics.jsonl and eval.jsonl under runs/METHOD/seedK/, with its evaluations' responses
(generations/step_S/test_arith.jsonl) gzipped beside them as generations_step_S.jsonl.gz.
"""

import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if len(sys.argv) != 2:
    sys.exit(__doc__)
out = Path(sys.argv[1])
for part in ("grid", "."):
    results = out / part / "results.json"
    if not results.is_file():
        continue
    record = json.loads(results.read_text())
    for run in record["runs"].values():
        if not run.get("finished"):
            continue
        folder = Path(part) / "runs" / run["variant"] / f"seed{run['seed']}"
        (HERE / folder).mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            if (out / folder / name).is_file():
                shutil.copy(out / folder / name, HERE / folder / name)
        for responses in sorted((out / folder / "generations").glob("step_*/test_arith.jsonl")):
            target = HERE / folder / f"generations_{responses.parent.name}.jsonl.gz"
            with gzip.GzipFile(target, "wb", mtime=0) as f:  # mtime 0: the same bytes each sync
                f.write(responses.read_bytes())
    shutil.copy(results, HERE / part / "results.json")
    print(f"{part}: {sum(bool(r.get('finished')) for r in record['runs'].values())} finished runs")
