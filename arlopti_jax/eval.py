"""Evaluation on test sets, greedy and sampled; also a CLI for a checkpoint or HF folder.

    python -m arlopti_jax.eval --config=configs/kk_qwen2.5_3b_grpo_ar_lopti.py \\
        --config.data.test_files=data/kk/3ppl/test.parquet [--checkpoint=RUN/checkpoints/120]

Without ``--checkpoint`` the model in ``config.model.path`` (a Hugging Face folder) is
evaluated. Results print as a table and are appended to ``<run_dir>/eval.jsonl``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from arlopti_jax import distributed as dist
from arlopti_jax import run_setup
from arlopti_jax.tasks import load_reward_fn, score_batch


def is_correct(data_source: str, score: float) -> bool:
    """K&K: the full score 3 (format and answer right); other tasks: score >= 1."""
    return score >= (3.0 if data_source.startswith("kk_logic") else 1.0)


def decode_solutions(tokenizer, prompt_rows: list[dict], rollout, n: int) -> list[str]:
    """verl's ``solution_str``: the decoded prompt and response together, special tokens kept."""
    seqs = [prompt_rows[i // n]["prompt_ids"] + resp for i, resp in enumerate(rollout.responses())]
    return tokenizer.batch_decode(seqs, skip_special_tokens=False)


def score_rollout(config, reward_fn, tokenizer, rows: list[dict], rollout, n: int):
    texts = decode_solutions(tokenizer, rows, rollout, n)
    scores = score_batch(reward_fn, [rows[i // n]["data_source"] for i in range(len(texts))], texts,
                         [rows[i // n]["ground_truth"] for i in range(len(texts))],
                         [rows[i // n]["extra_info"] for i in range(len(texts))],
                         num_workers=config.reward.workers, timeout_s=config.reward.timeout_s)
    return texts, np.asarray(scores, np.float32)


class Evaluator:
    """Greedy and sampled accuracy and mean reward per test set. With several processes, each
    samples and scores its share of every chunk of prompts; scores are gathered."""

    def __init__(self, config, policy: run_setup.Policy, sampler, test_sets: dict, reward_fn):
        self.config, self.policy, self.sampler, self.sets, self.reward_fn = config, policy, sampler, test_sets, reward_fn
        self.greedy = run_setup.sampling_config(config, policy, greedy=True)
        self.sampled = run_setup.sampling_config(config, policy)

    def run(self, params, key) -> dict[str, float]:
        cfg = self.config
        out: dict[str, float] = {}
        cap = cfg.train.batch_prompts * cfg.rollout.n  # responses per generate call
        for name, ds in self.sets.items():
            rows = ds.rows if cfg.train.eval_max_prompts < 0 else ds.rows[:cfg.train.eval_max_prompts]
            for mode, sampling, n in (("greedy", self.greedy, 1), ("sampled", self.sampled, cfg.train.eval_n)):
                per = max(1, cap // n)
                scores, correct = [], []
                for start in range(0, len(rows), per):
                    chunk = rows[start:start + per]
                    chunk = chunk[self.sampler.process_share(len(chunk), sampling)]
                    key, sub = jax.random.split(key)
                    rollout = self.sampler.generate(params, [r["prompt_ids"] for r in chunk], n, sub, sampling)
                    _, s = score_rollout(cfg, self.reward_fn, self.policy.tokenizer, chunk, rollout, n)
                    ok = np.array([is_correct(chunk[i // n]["data_source"], v) for i, v in enumerate(s)], bool)
                    s, ok = dist.gather(s, ok)
                    scores.append(s)
                    correct += ok.tolist()
                out[f"eval/{name}/{mode}_acc"] = float(np.mean(correct))
                out[f"eval/{name}/{mode}_reward"] = float(np.mean(np.concatenate(scores)))
        for mode in ("greedy", "sampled"):
            accs = [v for k, v in out.items() if k.endswith(f"/{mode}_acc")]
            if accs:
                out[f"eval/avg/{mode}_acc"] = float(np.mean(accs))
        return out


def append_jsonl(path: Path, record: dict) -> None:
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def format_table(results: dict[str, float]) -> str:
    names = sorted({k.split("/")[1] for k in results if k.startswith("eval/")})
    lines = [f"{'test set':<24}{'greedy acc':>12}{'sampled acc':>13}{'greedy reward':>15}"]
    for name in names:
        g, s = results.get(f"eval/{name}/greedy_acc"), results.get(f"eval/{name}/sampled_acc")
        r = results.get(f"eval/{name}/greedy_reward")
        fmt = lambda v: f"{v:.3f}" if v is not None else "-"
        lines.append(f"{name:<24}{fmt(g):>12}{fmt(s):>13}{fmt(r):>15}")
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.config import ConfigError, validate
    from arlopti_jax.rollout import Sampler

    config = flags.FLAGS.config
    try:
        dist.initialize(config)  # several processes: every one runs this command
        validate(config, jax.device_count())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mesh = run_setup.make_mesh(config)
    model_path, _, test_files = run_setup.resolve_paths(config)
    if not test_files:
        print("error: config.data.test_files is empty: nothing to evaluate", file=sys.stderr)
        return 2
    policy = run_setup.load_policy(config, mesh, model_path)
    params, label = policy.params, str(model_path)
    if flags.FLAGS.checkpoint:
        from arlopti_jax.checkpoint import Checkpointer

        folder = Path(flags.FLAGS.checkpoint)
        optimizer = run_setup.make_optimizer(config, total_rl_steps=max(1, config.train.max_steps))
        target = run_setup.abstract_state(policy.model_cfg, optimizer, mesh)
        ckpt = Checkpointer(folder.parent)
        state, _ = ckpt.restore(int(folder.name), target)
        ckpt.close()
        params, label = state["params"], str(folder)
    sets = {run_setup.eval_set_name(f): run_setup.prompt_dataset(config, [f], policy.tokenizer) for f in test_files}
    evaluator = Evaluator(config, policy, Sampler(policy.model_cfg, mesh), sets, load_reward_fn(config.reward.fn or None))
    start = time.time()
    results = evaluator.run(params, jax.random.key(config.seed))
    append_jsonl(Path(config.run_dir) / "eval.jsonl", {"model": label, "time": time.time(), **results})
    if jax.process_index() == 0:
        print(format_table(results))
        print(f"evaluated {label} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    from arlopti_jax.config import parse_command_line
    from arlopti_jax.train import DEFAULT_CONFIG

    def define():
        flags.DEFINE_string("checkpoint", "", "A checkpoint step folder (…/checkpoints/<step>) to evaluate.")
        config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Python config file (see configs/).", lock_config=True)

    sys.exit(main(parse_command_line(sys.argv, DEFAULT_CONFIG, define)))
