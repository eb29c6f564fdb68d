"""From config to run objects: EOS ids from generation_config.json (stopping and response mask), the
sampled evaluation's own temperature, and the data fields (columns, a default data source, Hub
dataset names) as a run's start-up reads them."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from arlopti_jax.rl import run_setup
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.config import base_config
from arlopti_jax.rl.evaluation import Evaluator
from arlopti_jax.models import load_pretrained
from arlopti_jax.rollout import Sampler
from hf_fixtures import write_hf_model
from run_fixtures import make_config, overrides


class NoEosTokenizer:
    eos_token_id = None
    pad_token_id = 0


def test_eos_ids_from_generation_config_stop_the_sampler(tmp_path):
    folder = write_hf_model(tmp_path / "hf", seed=3)  # config.json: eos_token_id 2
    mesh = shd.make_mesh({"fsdp": -1})
    model_cfg, params = load_pretrained(folder, mesh=mesh, dtype="float32", param_dtype="float32")
    policy = run_setup.Policy(model_cfg, params, NoEosTokenizer(), folder)
    config = base_config()
    config.rollout.max_response_length, config.rollout.temperature = 24, 1.0
    sampler = Sampler(model_cfg, mesh)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 8
    key = jax.random.key(0)

    # without stop tokens, the two tokens this random model draws most often
    sampling_of = lambda: run_setup.sampling_config(config, run_setup.eos_ids(policy), run_setup.pad_id(policy))
    free = sampler.generate(params, prompts, 1, key, dataclasses.replace(sampling_of(), eos_ids=()))
    counts = np.bincount(free.response_ids.ravel(), minlength=model_cfg.vocab_size)
    counts[2] = 0
    a, b = (int(i) for i in np.argsort(counts)[-2:])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [a, b], "pad_token_id": 0}))
    assert run_setup.eos_ids(policy) == tuple(sorted({2, a, b}))

    sampling = sampling_of()
    got = sampler.generate(params, prompts, 1, key, sampling)
    stopped_at = set()
    for row in range(len(prompts)):
        tokens = free.response_ids[row].tolist()  # randomness is per position: the same draws
        end = next((t + 1 for t, tok in enumerate(tokens) if tok in (2, a, b)), len(tokens))
        assert got.lengths[row] == end and got.response_mask[row].tolist() == [1] * end + [0] * (24 - end)
        assert got.response_ids[row, :end].tolist() == tokens[:end]
        if end < 24:
            stopped_at.add(tokens[end - 1])
    assert {a, b} <= stopped_at  # the sampler stopped at either id

    (folder / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        run_setup.eos_ids(policy)


def test_sampled_evaluation_uses_eval_temperature(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "t", **{"train.eval_n": 2, "train.eval_ks": (1, 2),
                                                       "rollout.temperature": 1.0})
    test_file = start_point / "data" / "test_2ppl.parquet"

    def evaluate(eval_temperature):
        config = make_config({**values, "train.eval_temperature": eval_temperature})
        mesh = run_setup.make_mesh(config)
        policy = run_setup.load_policy(config, mesh, start_point / "model")
        sets = {"t": run_setup.prompt_dataset(config, [test_file], policy.tokenizer)}
        run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                                 pad_id=run_setup.pad_id(policy), total_steps=1)
        evaluator = Evaluator(config, run, policy.tokenizer, sets, lambda *a: 0.0)
        assert evaluator.sampled.temperature == eval_temperature and evaluator.greedy.greedy
        assert evaluator.settings["eval_temperature"] == eval_temperature
        return evaluator, policy

    # near zero temperature, sampling is greedy decoding: the same responses
    evaluator, policy = evaluate(1e-4)
    rows = evaluator.sets["t"].rows[:8]
    prompts = [r["prompt_ids"] for r in rows]
    greedy = evaluator.sampler.generate(policy.params, prompts, 1, jax.random.key(1), evaluator.greedy)
    cold = evaluator.sampler.generate(policy.params, prompts, 1, jax.random.key(1), evaluator.sampled)
    assert greedy.responses() == cold.responses()
    hot_eval, _ = evaluate(5.0)
    hot = hot_eval.sampler.generate(policy.params, prompts, 1, jax.random.key(1), hot_eval.sampled)
    assert hot.responses() != greedy.responses()


@pytest.mark.parametrize("scale", ["cpu", "smollm2", "smollm2-gpu"])
def test_the_step_count_control_is_grpo_with_as_many_optimizer_steps_as_lopti(scale, tmp_path):
    from arlopti_jax.experiments import sweep

    def config(variant):
        c = sweep.run_config(sweep.base_config(scale), variant, 0, tmp_path, tmp_path / "sp", 8, 0, 0, False, scale)
        c.run_dir = c.train.mini_batch = c.train.micro_batch = None  # compared below
        return c

    def steps_per_rl_step(variant):  # optimizer steps: one per mini-batch per update pass
        c = sweep.run_config(sweep.base_config(scale), variant, 0, tmp_path, tmp_path / "sp", 8, 0, 0, False, scale)
        assert c.train.mini_batch % c.train.micro_batch == 0
        return (2 if c.algo.lopti_eta else 1) * (c.train.batch_prompts * c.rollout.n) // c.train.mini_batch

    assert steps_per_rl_step("grpo_2x_steps") == steps_per_rl_step("grpo_lopti") == 2 * steps_per_rl_step("grpo")
    assert config("grpo_2x_steps").to_dict() == config("grpo").to_dict()  # nothing else differs


def test_the_data_fields_reach_the_run_and_an_unknown_data_source_stops_its_start_up(start_point, tmp_path,
                                                                                      monkeypatch):
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"data.train_files": str(qa), "data.test_files": str(qa), "data.prompt_key": "question",
              "data.answer_key": "answer", "data.data_source": "arith", "data.prompt_style": "messages"}
    inputs = run_setup.prepare_inputs(make_config(overrides(start_point, tmp_path / "run", **fields)))
    tok = inputs.tokenizer
    for data in (inputs.iterator.dataset, inputs.test_sets["qa"]):
        assert [r["ground_truth"] for r in data.rows] == ["3", "7", "11", "15"]
        assert {r["data_source"] for r in data.rows} == {"arith"}
        assert [r["prompt_text"] for r in data.rows] == [
            tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                    add_generation_prompt=True) for r in rows]
    # the built-in reward has no 'gsm8k': the start-up says so, naming the field; a reward.fn may take it
    unknown = make_config(overrides(start_point, tmp_path / "run", **{**fields, "data.data_source": "gsm8k"}))
    with pytest.raises(ValueError, match="^config.data.train_files: no reward function for data_source 'gsm8k'"):
        run_setup.prepare_inputs(unknown)
    (tmp_path / "my_rewards.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                            "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    unknown.reward.fn = "my_rewards:score"  # the start-up imports it, and then takes any data_source
    assert run_setup.prepare_inputs(unknown).iterator.dataset.rows[0]["data_source"] == "gsm8k"


def test_hub_dataset_names_in_the_data_fields(start_point, tmp_path):
    from arlopti_jax.tasks.hub_data import HubSplit

    config = make_config(overrides(start_point, tmp_path / "run", **{
        "data.train_files": "acme/tiny-qa", "data.test_files": "acme/tiny-qa,openai/gsm8k:main:test"}))
    _, train, test = run_setup.resolve_paths(config)
    assert train == [HubSplit("acme/tiny-qa", "train")]  # each field's split when none is named
    assert test == [HubSplit("acme/tiny-qa", "test"), HubSplit("openai/gsm8k", "test", "main")]
    assert [run_setup.eval_set_name(f) for f in test] == ["tiny-qa_test", "gsm8k_main_test"]


@pytest.mark.parametrize("lopti_eta", [0.0, 0.5])
def test_the_schedule_counts_every_epochs_optimizer_steps(lopti_eta):
    """train.ppo_epochs multiplies the optimizer steps per RL step (mini-batches x passes x epochs),
    so warmup_cosine ends its decay at the run's last optimizer step, not halfway through it."""
    from arlopti_jax import algos

    def config(epochs):
        c = base_config()
        c.train.batch_prompts, c.rollout.n, c.train.mini_batch = 4, 4, 8  # 2 mini-batches
        c.algo.lopti_eta, c.train.ppo_epochs = lopti_eta, epochs
        c.optim.schedule, c.optim.warmup_steps, c.optim.min_lr_ratio = "warmup_cosine", 2, 0.1
        return c

    passes = 2 if lopti_eta else 1
    for epochs in (1, 2, 3):
        assert run_setup.optimizer_steps_per_rl_step(config(epochs)) == 2 * passes * epochs
        optim = run_setup.optim_config(config(epochs), total_rl_steps=5)
        assert optim.total_steps == 5 * 2 * passes * epochs
        schedule = algos.make_schedule(optim)
        assert float(schedule(optim.total_steps)) == pytest.approx(optim.lr * 0.1)
        assert float(schedule(optim.total_steps // 2)) > optim.lr * 0.5  # mid-run: still near the peak
    short = config(2)
    short.optim.warmup_steps = 8 * passes
    with pytest.raises(ValueError, match=rf"this run has {8 * passes} \(2 RL steps x {4 * passes}\)"):
        run_setup.optim_config(short, total_rl_steps=2)
