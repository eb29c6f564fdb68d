"""analysis/cross_task.py: the paired differences and quartile shares it prints, against numpy on
records whose values vary by method, seed and rate."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "analysis" / "cross_task.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cross_task", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(variant, seed, greedy, sampled, norms=None, finished=True):
    return {"variant": variant, "seed": seed, "finished": finished, "rewards": [],
            "evals": [{"step": 0, "eval/avg/greedy_acc": 0.0, "eval/avg/sampled_acc": 0.0},
                      {"step": 16, "eval/avg/greedy_acc": greedy, "eval/avg/sampled_acc": sampled}],
            "quartile_grad_norms": [[4 * i, *row] for i, row in enumerate(norms if norms is not None else [])]}


def write(folder: Path, runs: dict, grid: dict | None = None):
    (folder / "grid").mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"runs": runs}))
    (folder / "grid" / "results.json").write_text(json.dumps({"runs": grid or {}}))


def cells(table: str, label: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_cross_task_tables_equal_numpy(tmp_path, capsys):
    rng = np.random.default_rng(0)
    acc = {(m, s, t): rng.uniform(0.2, 0.9, 2) for m in ("grpo", "grpo_ar", "cispo") for s in range(4) for t in (0, 1)}
    norms = {(m, s, t): rng.uniform(0.01, 2.0, (2, 4)) for m in ("grpo", "grpo_ar", "cispo") for s in range(4)
             for t in (0, 1)}
    for t, name in ((0, "one"), (1, "harder")):
        runs = {f"{m}/seed{s}": run(m, s, *acc[m, s, t], norms[m, s, t].tolist())
                for m in ("grpo", "grpo_ar", "cispo") for s in range(4) if not (m == "cispo" and s == 3)}
        runs["grpo_ar/seed9"] = run("grpo_ar", 9, 0.0, 0.0, finished=False)  # unfinished: left out
        grid = {f"{m}@lr{r}/seed{s}": run(f"{m}@lr{r}", s, *rng.uniform(0, 1, 2))
                for m in ("grpo", "grpo_ar") for r in ("1e-06", "1e-05") for s in (100, 101)} if t else None
        write(tmp_path / name, runs, grid)
    assert load_script().main(["--one", str(tmp_path / "one"), "--harder", str(tmp_path / "harder")]) == 0
    out = capsys.readouterr().out
    cross, same = out.split("\n\n")

    def paired(m, t, k, seeds=range(4)):
        d = np.array([acc[m, s, t][k] - acc["grpo", s, t][k] for s in seeds])
        return f"{d.mean():+.3f} ({d.std(ddof=1) / np.sqrt(len(d)):.3f})"

    def share(m, t, seeds=range(4)):
        x = np.array([norms[m, s, t].mean(0)[0] / norms[m, s, t].mean(0).sum() for s in seeds])
        return f"{x.mean():.3f} ± {x.std(ddof=1) / np.sqrt(len(x)):.3f}"

    assert cells(cross, "GRPO + AR") == [paired("grpo_ar", 0, 0), paired("grpo_ar", 1, 0), paired("grpo_ar", 0, 1),
                                         paired("grpo_ar", 1, 1), share("grpo_ar", 0), share("grpo_ar", 1)]
    assert cells(cross, "CISPO")[1] == paired("cispo", 1, 0, range(3))  # the seeds both methods have
    assert cells(cross, "CISPO")[5] == share("cispo", 1, range(3))
    assert cells(cross, "GRPO")[:4] == ["-"] * 4

    grid = json.loads((tmp_path / "harder" / "grid" / "results.json").read_text())["runs"]
    final = {k: grid[k]["evals"][-1] for k in grid}
    every = {key: [] for key in ("eval/avg/greedy_acc", "eval/avg/sampled_acc")}
    expect = []
    for r in ("1e-06", "1e-05"):
        d = {key: [final[f"grpo_ar@lr{r}/seed{s}"][key] - final[f"grpo@lr{r}/seed{s}"][key] for s in (100, 101)]
             for key in every}
        expect.append(" / ".join(f"{np.mean(d[key]):+.3f}" for key in every))
        for key in every:
            every[key] += d[key]
    expect.append(" / ".join(f"{np.mean(v):+.3f} ({np.std(v, ddof=1) / 2:.3f})" for v in every.values()))
    assert cells(same, "GRPO + AR") == expect
    assert "lr 1e-06" in same.splitlines()[0] and "lr 1e-05" in same.splitlines()[0]


def test_records_that_are_not_there_get_one_error_line(tmp_path):
    with pytest.raises(SystemExit, match=r"error: .*nowhere/results.json: not a sweep's records"):
        load_script().main(["--harder", str(tmp_path / "nowhere")])


def test_other_rate_table_pairs_each_rate_with_grpo(tmp_path, capsys):
    rng = np.random.default_rng(1)

    def timed(variant, seed, lr, values, norms):
        r = run(variant, seed, values[0], values[1], norms.tolist())
        r["evals"][-1]["eval/avg/pass@4"] = values[2]
        return {**r, "lr": lr}

    acc = {(m, s): rng.uniform(0.2, 0.9, 3) for m in ("grpo", "grpo_ar", "ar_same") for s in range(5)}
    norms = {(m, s): rng.uniform(0.01, 2.0, (2, 4)) for m in ("grpo", "grpo_ar", "ar_same") for s in range(5)}
    runs = {f"{m}/seed{s}": timed(m, s, 3e-6 if m == "grpo" else 1e-5, acc[m, s], norms[m, s])
            for m in ("grpo", "grpo_ar") for s in range(5)}
    write(tmp_path / "harder", runs)
    write(tmp_path / "one", runs)
    # the other rate: seeds 0-3 (seed 4 unfinished), variant grpo_ar at GRPO's rate
    extra = {f"grpo_ar/seed{s}": timed("grpo_ar", s, 3e-6, acc["ar_same", s], norms["ar_same", s]) for s in range(4)}
    extra["grpo_ar/seed4"] = {**timed("grpo_ar", 4, 3e-6, acc["ar_same", 4], norms["ar_same", 4]), "finished": False}
    write(tmp_path / "same", extra)
    script = load_script()
    assert script.main(["--one", str(tmp_path / "one"), "--harder", str(tmp_path / "harder"),
                        "--same-rate", str(tmp_path / "same")]) == 0
    table = capsys.readouterr().out.split("\n\n")[2]
    rows = [line for line in table.splitlines() if line.startswith("| GRPO + AR |")]

    def expect(m, seeds):
        out = []
        for k in range(3):
            d = np.array([acc[m, s][k] - acc["grpo", s][k] for s in seeds])
            out.append(f"{d.mean():+.3f} ({d.std(ddof=1) / np.sqrt(len(d)):.3f})")
        x = np.array([norms[m, s].mean(0)[0] / norms[m, s].mean(0).sum() for s in seeds])
        return out + [f"{x.mean():.3f} ± {x.std(ddof=1) / np.sqrt(len(x)):.3f}"]

    assert [c.strip() for c in rows[0].strip("|").split("|")][1:] == ["1e-05", "5", *expect("grpo_ar", range(5))]
    assert [c.strip() for c in rows[1].strip("|").split("|")][1:] == ["3e-06", "4", *expect("ar_same", range(4))]
    with pytest.raises(SystemExit, match="error: .*missing"):
        script.main(["--one", str(tmp_path / "one"), "--harder", str(tmp_path / "harder"),
                     "--same-rate", str(tmp_path / "missing")])
