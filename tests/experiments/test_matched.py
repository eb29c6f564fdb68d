"""The step-matched protocol (reproduce --matched, arlopti_jax/experiments/matched.py): matched optimizer steps,
the validation split, the learning-rate choice, and the report's statistics against numpy, on
synthetic records (no training); the protocol end to end on the --quick start point is slow."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arlopti_jax.experiments import matched
from arlopti_jax.experiments import sweep
from arlopti_jax.experiments.matched_report import (accuracy_table, grid_table, paired_table, protocol,
                                                    quartile_table, write_matched_report)
from arlopti_jax.rl.run_setup import optimizer_steps_per_rl_step


@pytest.mark.parametrize("scale", ["cpu", "smollm2", "smollm2-gpu", "smollm2-addsub20", "smollm2-addsub20-gpu"])
def test_every_method_makes_the_same_optimizer_steps_and_differs_only_in_its_method(scale, tmp_path):
    base = sweep.base_config(scale)
    steps = matched.matched_optimizer_steps(base, scale)
    own = {m: optimizer_steps_per_rl_step(sweep.run_config(base, m, 0, tmp_path, tmp_path, 8, 0, 0, False, scale))
           for m in sweep.MATCHED_METHODS}
    assert steps == max(own.values()) == 2 * own["grpo"] == own["grpo_lopti"]  # Lopti's two passes set it

    def config(method, **kw):
        return sweep.run_config(base, method, 0, tmp_path, tmp_path, 8, 0, 0, False, scale, optimizer_steps=steps,
                                lr=2e-6, data=("fit.parquet", "val.parquet"), **kw)

    grpo = config("grpo")
    assert optimizer_steps_per_rl_step(grpo) == steps and grpo.optim.lr == 2e-6
    assert (grpo.data.train_files, grpo.data.test_files) == ("fit.parquet", "val.parquet")
    # grpo_2x_steps, made general: matched GRPO is the control with the rate and data set
    control = sweep.run_config(base, "grpo_2x_steps", 0, tmp_path, tmp_path, 8, 0, 0, False, scale, lr=2e-6,
                               data=("fit.parquet", "val.parquet"))
    assert grpo.to_dict() == control.to_dict()
    flat = lambda c: {f"{g}.{k}": v for g, sec in c.to_dict().items() if isinstance(sec, dict) for k, v in sec.items()}
    for method in sweep.MATCHED_VARIANTS:  # the methods, and the staleness variants of two of them
        c = config(method)
        assert optimizer_steps_per_rl_step(c) == steps, method
        differs = {k for k, v in flat(c).items() if flat(grpo)[k] != v}
        allowed = set(sweep.VARIANTS[method][1]) | {"train.mini_batch", "train.micro_batch"}
        assert differs <= allowed, (method, differs - allowed)
    stale = config("grpo_ar_lopti_k1_tis")
    assert (stale.rollout.max_staleness, stale.rollout.correction, stale.algo.lopti_eta) == (1, "tis", 0.5)


def test_ppo_epochs_multiply_every_methods_steps_and_the_matched_count_alike(tmp_path):
    """A scale config with train.ppo_epochs = 2: the matched count is twice mu = 1's, every method
    makes it, with the mini-batches of mu = 1 (the epochs multiply each method's steps alike); the
    record and the report say so."""
    once, twice = sweep.base_config("cpu"), sweep.base_config("cpu")
    twice.train.ppo_epochs = 2
    steps = matched.matched_optimizer_steps(twice, "cpu")
    assert steps == 2 * matched.matched_optimizer_steps(once, "cpu")
    for method in sweep.MATCHED_METHODS:
        c1, c2 = (sweep.run_config(base, method, 0, tmp_path, tmp_path, 8, 0, 0, False, "cpu", optimizer_steps=n)
                  for base, n in ((once, steps // 2), (twice, steps)))
        assert optimizer_steps_per_rl_step(c2) == steps and c2.train.mini_batch == c1.train.mini_batch, method
    runs = sweep.Sweep(tmp_path, ["grpo"], [0], 8, 0, None, 0, "cpu")
    assert runs.describe("grpo/seed0", c2)["ppo_epochs"] == 2
    results = {"runs": {"grpo/seed0": {**record("grpo", 0, 0.5, 0.5, 0.5), "ppo_epochs": 2}}, "steps": 8,
               "variants": ["grpo"], "seeds": [0], "matched": {"optimizer_steps_per_rl_step": 4}}
    assert "once per mini-batch, in each of 2 epochs over a rollout batch)" in " ".join(protocol(results))
    results["runs"]["grpo/seed0"].pop("ppo_epochs")  # a record from before the field: one epoch
    assert "once per mini-batch)" in " ".join(protocol(results))


def test_matched_runs_measure_the_quartile_norms_on_the_whole_batch(tmp_path):
    from arlopti_jax.config import ConfigError, validate

    base = sweep.base_config("smollm2")
    steps = matched.matched_optimizer_steps(base, "smollm2")
    runs = matched.MatchedSweep(tmp_path, ["grpo", "grpo_lopti"], [0], 8, 64, None, 2, "smollm2",
                                optimizer_steps=steps, lrs={"grpo": 1e-6, "grpo_lopti": 1e-5}, test="test",
                                val_prompts=16)
    configs = {m: runs.run_config(base, m, 0, tmp_path / m, tmp_path / "sp", False, "float32")
               for m in ("grpo", "grpo_lopti", "cispo@lr3e-06")}
    assert {c.train.mini_batch for c in configs.values()} == {8, 16}  # the methods' mini-batches differ ...
    assert all(c.train.diagnostics_rows == -1 and c.train.diagnostics_every == 2 for c in configs.values())
    assert [c.optim.lr for c in configs.values()] == [1e-6, 1e-5, 3e-6]
    for c in configs.values():
        validate(c)
    configs["grpo"].train.diagnostics_rows = -2
    with pytest.raises(ConfigError, match=r"config.train.diagnostics_rows=-2 is invalid: must be -1"):
        validate(configs["grpo"])


def test_validation_split_is_drawn_once_from_the_training_problems(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "sp" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"q": [f"problem {i}" for i in range(50)], "i": list(range(50))}), data / "train.parquet")
    train, val = matched.split_train(tmp_path / "sp", tmp_path / "split", 12)
    t, v = pq.read_table(train).column("i").to_pylist(), pq.read_table(val).column("i").to_pylist()
    assert len(v) == 12 and sorted(t + v) == list(range(50)) and not set(t) & set(v)
    assert t == sorted(t) and v != list(range(12))  # drawn, not the first rows; training order kept
    again = matched.split_train(tmp_path / "sp", tmp_path / "split2", 12)
    assert pq.read_table(again[1]).column("i").to_pylist() == v  # the same split from the same data
    assert matched.split_train(tmp_path / "sp", tmp_path / "split", 12) == (train, val)  # reused
    with pytest.raises(SystemExit, match="holds a validation split of 12 problems, not --val-prompts 10"):
        matched.split_train(tmp_path / "sp", tmp_path / "split", 10)


def record(variant, seed, sampled, greedy, passk, norms=None):
    ev = {"step": 8, "eval/avg/sampled_acc": sampled, "eval/avg/greedy_acc": greedy, "eval/avg/pass@4": passk,
          "eval/avg/pass@1": sampled}
    return {"variant": variant, "seed": seed, "finished": True, "evals": [ev], "rewards": [0.1],
            "quartile_grad_norms": [[0, *row] for row in (norms if norms is not None else [])], "isolation": None,
            "lr": 1e-6, "mini_batch": 8, "optimizer_steps_per_rl_step": 4}


def test_the_choice_is_the_best_mean_validation_sampled_accuracy():
    lrs, seeds = [1e-6, 3e-6, 1e-5], [100, 101]
    sampled = {("grpo", 1e-6): (0.2, 0.3), ("grpo", 3e-6): (0.5, 0.4), ("grpo", 1e-5): (0.45, 0.44),
               ("cispo", 1e-6): (0.6, 0.6), ("cispo", 3e-6): (0.6, 0.6), ("cispo", 1e-5): (0.1, 0.2)}
    greedy = {("cispo", 1e-6): 0.7, ("cispo", 3e-6): 0.8}
    runs = {f"{matched.grid_name(m, lr)}/seed{s}": record(matched.grid_name(m, lr), s, v[i],
                                                              greedy.get((m, lr), 0.5), 0.9)
            for (m, lr), v in sampled.items() for i, s in enumerate(seeds)}
    choice = matched.choose_lrs({"runs": runs}, {"grpo": lrs, "cispo": lrs}, seeds)
    assert choice["grpo"]["lr"] == 3e-6 and not choice["grpo"]["edge"]  # 0.45 > 0.445 > 0.25
    assert choice["cispo"]["lr"] == 3e-6  # a tie on sampled accuracy: the greedy one decides
    mean, se, n = choice["grpo"]["scores"]["3e-06"]["sampled"]
    assert (mean, n) == (pytest.approx(0.45), 2) and se == pytest.approx(np.std([0.5, 0.4], ddof=1) / math.sqrt(2))
    del runs["cispo@lr1e-05/seed101"]
    with pytest.raises(SystemExit, match=r"grid is missing 1 runs \(cispo@lr1e-05/seed101"):
        matched.choose_lrs({"runs": runs}, {"grpo": lrs, "cispo": lrs}, seeds)
    assert matched.parse_name("top_entropy@lr3e-06") == ("top_entropy", 3e-6)
    assert matched.parse_lrs("grpo=3e-6,gspo=1e-5") == {"grpo": 3e-6, "gspo": 1e-5}
    assert matched.parse_lrs("grpo_k1=3e-6,grpo_ar_lopti_k1_tis=1e-5") == {"grpo_k1": 3e-6,
                                                                         "grpo_ar_lopti_k1_tis": 1e-5}
    for bad, message in (("ppo=1e-6", "'ppo' is not one of"), ("grpo=fast", "expected METHOD=RATE"),
                         ("grpo=0", "must be > 0")):
        with pytest.raises(ValueError, match=message):
            matched.parse_lrs(bad)


def test_a_best_rate_at_an_end_of_the_grid_is_tried_beyond_it():
    lrs, seeds = [1e-6, 3e-6, 1e-5], [100]
    sampled = {("grpo", 1e-6): 0.2, ("grpo", 3e-6): 0.5, ("grpo", 1e-5): 0.7,  # best at the top
               ("cispo", 1e-6): 0.6, ("cispo", 3e-6): 0.4, ("cispo", 1e-5): 0.1,  # at the bottom
               ("gspo", 1e-6): 0.2, ("gspo", 3e-6): 0.5, ("gspo", 1e-5): 0.3}  # inside
    runs = {f"{matched.grid_name(m, lr)}/seed100": record(matched.grid_name(m, lr), 100, v, 0.5, 0.9)
            for (m, lr), v in sampled.items()}
    rates = {m: list(lrs) for m in ("grpo", "cispo", "gspo")}
    choice = matched.choose_lrs({"runs": runs}, rates, seeds)
    assert [choice[m]["edge"] for m in rates] == [True, True, False]
    assert matched.grid_extensions(rates, choice) == {"grpo": 3e-5, "cispo": 3e-7}  # 1e-5 * (1e-5 / 3e-6), 1 digit
    assert matched.next_rate([1e-4, 3e-4], 3e-4) == 9e-4 and matched.next_rate([1e-6, 1e-5, 1e-4], 1e-6) == 1e-7
    # the extended grid: grpo's new rate is the best, so it is chosen; a missing extension run is refused
    rates["grpo"].append(3e-5)
    runs["grpo@lr3e-05/seed100"] = record("grpo@lr3e-05", 100, 0.8, 0.5, 0.9)
    choice = matched.choose_lrs({"runs": runs}, {"grpo": rates["grpo"], "gspo": rates["gspo"]}, seeds)
    assert choice["grpo"]["lr"] == 3e-5 and choice["grpo"]["edge"] and choice["gspo"]["lr"] == 3e-6
    table = table_rows(grid_table(choice))
    assert table["GRPO"] == ["0.200 (n=1)", "0.500 (n=1)", "0.700 (n=1)", "0.800 (n=1)", "3e-05 (edge of the grid)"]
    assert table["GSPO"][3] == "-"  # gspo did not run 3e-5
    with pytest.raises(SystemExit, match=r"grid is missing 1 runs \(cispo@lr3e-07/seed100"):
        matched.choose_lrs({"runs": runs}, {"cispo": rates["cispo"] + [3e-7]}, seeds)


def table_rows(table: str) -> dict[str, list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    return {r.split("|")[1].strip(): [c.strip() for c in r.strip().strip("|").split("|")[1:]] for r in rows}


def test_report_means_standard_errors_and_paired_differences_match_numpy(tmp_path):
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2, 3, 4]
    values = {m: rng.uniform(0.3, 0.9, (len(seeds), 3)) for m in ("grpo", "grpo_lopti", "cispo")}
    norms = {m: rng.uniform(0.01, 1.0, (len(seeds), 2, 4)) for m in values}
    runs = {f"{m}/seed{s}": record(m, s, *values[m][i], norms=norms[m][i]) for m in values
            for i, s in enumerate(seeds)}
    del runs["cispo/seed3"]  # a missing run: cispo is paired with GRPO on 4 seeds
    results = {"runs": runs, "steps": 8, "variants": list(values), "seeds": seeds, "eval_prompts": 64,
               "diagnostics_every": 2,
               "matched": {"optimizer_steps_per_rl_step": 4, "lr": {"grpo": 3e-6, "grpo_lopti": 1e-5, "cispo": 1e-6},
                           "lr_grid": [1e-6, 3e-6, 1e-5], "grid_seeds": [100, 101], "val_prompts": 128,
                           "fixed_lr": {}, "choice": {}}}
    acc = table_rows(accuracy_table(results))
    cispo = np.delete(values["cispo"], 3, axis=0)
    for label, x in (("GRPO", values["grpo"]), ("CISPO", cispo)):
        for j, k in enumerate((1, 0, 2)):  # the columns greedy, sampled, pass@4; the record's values sampled, greedy
            want = f"{x[:, k].mean():.3f} ± {x[:, k].std(ddof=1) / math.sqrt(len(x)):.3f}"
            assert acc[label][2 + j] == want, (label, j)
    assert acc["CISPO"][:2] == ["1e-06", "4"]
    paired = table_rows(paired_table(results))
    assert "GRPO" not in paired and paired["CISPO"][0] == "4"
    d = cispo[:, 0] - np.delete(values["grpo"], 3, axis=0)[:, 0]  # sampled accuracy, seeds 0, 1, 2, 4
    assert paired["CISPO"][2] == f"{d.mean():+.3f} ({d.std(ddof=1) / math.sqrt(4):.3f})"
    quart = table_rows(quartile_table(results))
    per_run = norms["grpo_lopti"].mean(axis=1)  # mean over each run's logged steps
    ratio = per_run[:, 0] / per_run[:, 3]
    assert quart["GRPO + Lopti"][1] == f"{per_run[:, 0].mean():.3g} ± {per_run[:, 0].std(ddof=1) / math.sqrt(5):.3g}"
    assert quart["GRPO + Lopti"][5] == f"{ratio.mean():.1f} ± {ratio.std(ddof=1) / math.sqrt(5):.1f}"
    share = per_run[:, 0] / per_run.sum(1)
    assert quart["GRPO + Lopti"][6] == f"{share.mean():.3f} ± {share.std(ddof=1) / math.sqrt(5):.3f}"
    report = write_matched_report(results, {"runs": {}}, tmp_path, "reproduce --matched").read_text()
    assert "Every run made 4 optimizer steps per RL step (" in report and "NOT MATCHED" not in report
    assert "never the test set" in report and "## Gradient norm per pi_old quartile" in report
    assert "**Runs: 14 of 15 finished** (a sweep stopped part-way)" in report


def test_report_only_writes_the_report_of_a_stopped_sweep_from_its_records(tmp_path, capsys):
    from arlopti_jax import reproduce

    out = tmp_path / "m"

    def refused(*flags: str) -> str:
        assert reproduce.main([*flags, "--out", str(out), "--report-only"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --report-only: ") and "\n" not in err, err
        return err

    assert "results.json is not there: no sweep has recorded a run" in refused("--matched")
    out.mkdir()
    (out / "results.json").write_text("{")
    assert "results.json is not a sweep's records" in refused("--matched")
    runs = {f"{m}/seed{s}": record(m, s, 0.5 + 0.1 * s, 0.6, 0.9) for m in ("grpo", "cispo") for s in (0, 1)}
    runs["cispo/seed1"]["finished"] = False  # stopped mid-run
    results = {"runs": runs, "steps": 8, "variants": ["grpo", "cispo"], "seeds": [0, 1], "eval_prompts": 64,
               "matched": {"optimizer_steps_per_rl_step": 4, "lr": {"grpo": 1e-5, "cispo": 1e-5}}}
    (out / "results.json").write_text(json.dumps(results))
    assert "records of a --matched sweep: add --matched" in refused()
    assert reproduce.main(["--matched", "--out", str(out), "--scale", "smollm2", "--report-only"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out / 'matched.md'}"
    report = (out / "matched.md").read_text()
    assert "Command: `python -m arlopti_jax.reproduce --matched --out " in report and "--report-only" not in report
    assert "**Runs: 3 of 4 finished**" in report
    assert "| CISPO | 1e-05 | 1 | 0.600 (n=1) | 0.500 (n=1) | 0.900 (n=1) |" in report  # seed 0 only
    assert "| GRPO | 1e-05 | 2 | 0.600 ± 0.000 | 0.550 ± 0.050 | 0.900 ± 0.000 |" in report


def run_quick_matched(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--quick", "--matched", "--out", str(out),
                           "--val-prompts", "16", "--diagnostics-every", "1", *extra],
                          capture_output=True, text=True, env=env, timeout=1800)


@pytest.mark.slow  # 9 or 10 tiny runs in 2 worker processes and a repeat of one: about 2 minutes on 2 cores
def test_quick_matched_protocol_end_to_end_and_a_cell_reproduced_from_its_record(tmp_path):
    out = tmp_path / "m"
    proc = run_quick_matched(out, "--variants", "grpo,grpo_lopti,top_entropy", "--seeds", "0,1", "--lr-grid",
                             "1e-4,3e-4,1e-3", "--grid-seeds", "100", "--lr", "grpo_lopti=1e-3,top_entropy=3e-4",
                             "--jobs", "2", "--grid-extend", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = json.loads((out / "grid" / "results.json").read_text())
    assert all(set(e) >= {"eval/val/sampled_acc"} for r in grid["runs"].values() for e in r["evals"])
    # the grid, and one rate beyond its end if GRPO's best of the three was there (--grid-extend 1)
    first = matched.choose_lrs(grid, {"grpo": [1e-4, 3e-4, 1e-3]}, [100])["grpo"]
    rates = [1e-4, 3e-4, 1e-3] + ([matched.next_rate([1e-4, 3e-4, 1e-3], first["lr"])] if first["edge"] else [])
    assert sorted(grid["runs"]) == sorted(f"{matched.grid_name('grpo', lr)}/seed100" for lr in rates)
    results = json.loads((out / "results.json").read_text())
    chosen = matched.choose_lrs(grid, {"grpo": rates}, [100])["grpo"]["lr"]
    assert results["matched"]["lr"] == {"grpo": chosen, "grpo_lopti": 1e-3, "top_entropy": 3e-4}
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(sweep.__file__).parent,
                          capture_output=True, text=True).stdout.strip()  # "" outside a git checkout
    for name, run in results["runs"].items():
        assert run["finished"] and run["optimizer_steps_per_rl_step"] == 4, name
        assert (run["code"] or "").startswith(head), (name, run["code"])  # the commit that ran it
        assert run["lr"] == results["matched"]["lr"][run["variant"]]
        assert any(k.startswith("eval/test_") for k in run["evals"][-1]) and run["quartile_grad_norms"]
        run_dir = out / "runs" / name
        assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "checkpoints").exists()  # 1.4 GB on SmolLM2
    report = (out / "matched.md").read_text()
    assert "## Learning rates chosen on validation" in report and "80/20" in report
    # a cell from its record alone: the same evaluation
    cell = results["runs"]["top_entropy/seed1"]
    command = cell["command"].replace("OUT", str(tmp_path / "again")).split()
    assert command[:3] == ["python", "-m", "arlopti_jax.reproduce"]
    again = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    redo = json.loads((tmp_path / "again" / "results.json").read_text())["runs"]["top_entropy/seed1"]
    assert redo["evals"] == cell["evals"] and redo["rewards"] == cell["rewards"]
    assert re.search(r"\| 80/20 \(top 20% entropy\) \| 0.0003 \| 1 \|", (tmp_path / "again" / "matched.md").read_text())
