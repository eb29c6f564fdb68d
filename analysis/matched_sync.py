"""Copy a matched sweep's records (not its checkpoints) from its folder into the repository's
(docs/results/matched_smollm2), where the sweep's report and analysis/answer_form.py read them.

    python analysis/matched_sync.py OUT

For the grid (OUT/grid) and the comparison (OUT): results.json, and each finished run's
metrics.jsonl and eval.jsonl under runs/METHOD/seedK/, with its evaluations' responses
(generations/step_S/test_arith.jsonl) gzipped beside them as generations_step_S.jsonl.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "results" / "matched_smollm2"


def sync(out: Path, records: Path) -> None:
    for part in ("grid", "."):
        results = out / part / "results.json"
        if not results.is_file():
            continue
        record = json.loads(results.read_text())
        for run in record["runs"].values():
            if not run.get("finished"):
                continue
            folder = Path(part) / "runs" / run["variant"] / f"seed{run['seed']}"
            (records / folder).mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "eval.jsonl"):
                if (out / folder / name).is_file():
                    shutil.copy(out / folder / name, records / folder / name)
            for responses in sorted((out / folder / "generations").glob("step_*/test_arith.jsonl")):
                target = records / folder / f"generations_{responses.parent.name}.jsonl.gz"
                with gzip.GzipFile(target, "wb", mtime=0) as f:  # mtime 0: the same bytes each sync
                    f.write(responses.read_bytes())
        (records / part).mkdir(parents=True, exist_ok=True)
        shutil.copy(results, records / part / "results.json")
        print(f"{part}: {sum(bool(r.get('finished')) for r in record['runs'].values())} finished runs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the sweep's folder (reproduce --matched --out OUT)")
    ap.add_argument("--records", type=Path, default=RECORDS, help="where the records go (default: %(default)s)")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        ap.error(f"{args.out} is not a folder")
    sync(args.out, args.records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
