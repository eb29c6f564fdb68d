"""The warm start of tool use (``finetune/tool_traces.py``): a trace is the call in the environment's
format up to its stop string, the calculator's real output formatted as the episodes format it (the
same ids), and the answer; the SFT loss reads the call, the answer and the EOS, never the
observation; the baseline's trace is the answer alone, its prompt the tool arm's but for the
system message; no problem is both a trace and an RL training problem."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from arlopti_jax.finetune import tool_traces
from arlopti_jax.finetune.supervised import read_pairs, tokenize_pairs
from arlopti_jax.rollout.observations import ObservationFormat
from arlopti_jax.tasks import calc
from arlopti_jax.tasks.envs import load_environment
from arlopti_jax.tasks.tools import calculate
from task_fixtures import tiny_tokenizer

FORMAT = "\n<output>{observation}</output>\n"
TEXT_CALLS = {"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"}


@pytest.mark.parametrize("params", [TEXT_CALLS, {}], ids=["text", "json"])
def test_a_trace_calls_the_tool_and_trains_on_the_assistants_tokens_alone(tmp_path, params):
    tokenizer = tiny_tokenizer()
    factory = load_environment("calc", params)
    observations = ObservationFormat(tokenizer, FORMAT, 64)
    train, test = calc.generate(24, 4, seed=3)
    sft, train_file = tool_traces.write_start_point_data(tmp_path, train, test, factory.instructions, 8, 0, factory,
                                                         observations, True)
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    assert len(rows) == 8 and pq.read_table(train_file).num_rows == 16
    questions = {r["prompt"][1]["content"] for r in rows}
    assert not questions & {r["extra_info"]["question"] for r in pq.read_table(train_file).to_pylist()}
    by_question = {r["extra_info"]["question"]: r for r in train}
    data = tokenize_pairs(read_pairs([str(sft)]), tokenizer, 1024)
    for i, row in enumerate(rows):
        problem = by_question[row["prompt"][1]["content"]]
        call, observation, answer = row["response"]
        assert call["train"] and not observation["train"] and answer["train"]
        assert call["text"].endswith(factory.stop_strings[0]) and problem["extra_info"]["expression"] in call["text"]
        value = calculate(problem["extra_info"]["expression"]).output
        assert value == problem["reward_model"]["ground_truth"]
        assert observation["text"] == FORMAT.format(observation=value)
        assert answer["text"] == f"The answer is \\boxed{{{value}}}."
        assert row["prompt"][0] == {"role": "system", "content": factory.instructions}
        segments = [tokenizer(s["text"], add_special_tokens=False)["input_ids"] for s in row["response"]]
        assert segments[1] == observations(value)[0]  # the ids the episodes feed
        ids, mask = data["input_ids"][i], data["loss_mask"][i]
        n = int(data["attention_mask"][i].sum())
        response = sum(segments, []) + [tokenizer.eos_token_id]
        assert ids[n - len(response):n].tolist() == response
        want = [1] * len(segments[0]) + [0] * len(segments[1]) + [1] * len(segments[2]) + [1]
        assert mask[n - len(response):n].tolist() == want and not mask[:n - len(response)].any()


def test_the_baselines_warm_start_answers_at_once(tmp_path):
    factory = load_environment("calc", TEXT_CALLS)
    train, test = calc.generate(24, 4, seed=3)
    sft, _ = tool_traces.write_start_point_data(tmp_path, train, test, tool_traces.NO_TOOL, 8, 0, factory, None,
                                                False)
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    assert all(len(r["response"]) == 1 and r["response"][0]["text"].startswith("The answer is") for r in rows)
    assert all(r["prompt"][0]["content"] == tool_traces.NO_TOOL for r in rows)
    tool_rows = pq.read_table(tmp_path / "data" / "test_calc.parquet").to_pylist()
    assert [r["prompt"][1] for r in tool_rows] == [{"role": "user", "content": r["extra_info"]["question"]}
                                                   for r in test]
    with pytest.raises(ValueError, match="'response' must be a string or a list"):
        tokenize_pairs([{"prompt": "p", "response": [{"text": "a"}]}], tiny_tokenizer(), 64)
    assert np.asarray(tokenize_pairs([{"prompt": "p", "response": "a b"}], tiny_tokenizer(), 64)["loss_mask"]).sum() > 1
