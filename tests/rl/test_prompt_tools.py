"""Tool episodes with a Hub chat template that supports tools (Qwen2.5's, Qwen3's, from a folder as
the Hub ships it): the prompts carry the template's own tools section written from the
environment's schemas, equal to transformers' ``apply_chat_template(tools=...)`` token for token
and to the published format transcribed here; the call the template teaches is the one the
environment parses, and a whole episode (prompt, the drawn call, the fed observation) is the ids
of the conversation as the template writes it. A template that teaches another call format, or
prompts that are text already, stop in one line; the warm start's traces are rendered as the run's
prompts are; and a template without tool support with an empty
``env.observation_format`` stops ``train`` and ``eval`` at start-up, before anything is written."""

import json
import os
import subprocess

import pytest

from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from arlopti_jax.embedded.default import get_config
from arlopti_jax.models.tokenizer import load_tokenizer
from arlopti_jax.rl import episode_host, run_setup
from arlopti_jax.tasks import calc
from arlopti_jax.tasks.data import render_prompt
from arlopti_jax.tasks.envs import load_environment
from chat_templates import TEMPLATES, qwen_folder
from run_fixtures import cli, overrides

QUESTION = "What is 48213 * 907 + 5511?"
EXPRESSION = "48213 * 907 + 5511"
THOUGHT = "<think>\nA product of two large numbers: the calculator.\n</think>\n\nLet me compute it."
# the tools section both templates write after a system message, transcribed from their text
TOOLS_SECTION = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                 "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
                 "</tool_call><|im_end|>\n")


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def qwen(request, tmp_path_factory):
    """(template name, the tokenizer of a Hub-style folder with that template)."""
    folder = qwen_folder(tmp_path_factory.mktemp(request.param.replace(".", "")), request.param)
    return request.param, load_tokenizer(folder)


def env_config(**env):
    config = get_config()
    config.env.name = "calc"
    config.data.max_prompt_length = 4096  # the tiny vocabulary's prompts are long
    for key, value in env.items():
        config.env[key] = value
    return config


def ids(encoding):
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


def test_the_prompts_carry_the_templates_tools_section(qwen, tmp_path):
    name, tok = qwen
    train, _ = calc.generate(6, 2, seed=3)
    data = calc.write_parquet(train, tmp_path / "train.parquet")
    schemas = load_environment("calc").tools
    rows = run_setup.prompt_dataset(env_config(), [data], tok).rows
    assert len(rows) == len(train)
    for row, raw in zip(rows, train):
        messages = raw["prompt"]
        expected = ids(tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=True))
        assert row["prompt_ids"] == expected
        system = f"<|im_start|>system\n{messages[0]['content']}"
        assert row["prompt_text"].startswith(system + TOOLS_SECTION.format(schemas=json.dumps(schemas[0])))
        assert row["prompt_text"].endswith(f"{messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")

    plain = [ids(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)) for r in train]
    off = run_setup.prompt_dataset(env_config(template_tools=False), [data], tok).rows
    assert [r["prompt_ids"] for r in off] == plain and all("# Tools" not in r["prompt_text"] for r in off)
    single_turn = env_config(name="")  # no environment: no tools
    assert [r["prompt_ids"] for r in run_setup.prompt_dataset(single_turn, [data], tok).rows] == plain
    assert plain != [r["prompt_ids"] for r in rows]


def test_an_episode_is_the_conversation_the_template_writes(qwen):
    """The call the template teaches (written by the template itself from an assistant message's
    ``tool_calls``) is parsed and run by the environment, and prompt + drawn call + fed observation
    are the ids of the whole conversation as the template renders it, tool message included. (The
    turn thinks first: Qwen3 writes an assistant turn without reasoning as the last message with an
    empty think block and drops it in the history, a change of the template's, not of the ids drawn.)"""
    name, tok = qwen
    config = env_config(observation_tokens=64)
    factory = episode_host.env_factory(config)
    tools = episode_host.prompt_tools(config, tok)
    assert tools == factory.tools
    prompt = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": QUESTION}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": EXPRESSION}}}
    turn = {"role": "assistant", "content": THOUGHT, "tool_calls": [call]}
    with_call = tok.apply_chat_template(prompt + [turn], tools=tools, tokenize=False)
    prompt_text = render_prompt(prompt, tok, "messages", tools)
    assert with_call.startswith(prompt_text)
    action = with_call[len(prompt_text):].removesuffix("<|im_end|>\n")
    assert action.startswith(THOUGHT) and action.endswith(factory.stop_strings[0]) and action.count("<tool_call>") == 1

    env = factory()
    env.reset({"ground_truth": str(48213 * 907 + 5511)})
    step = env.step(action)
    assert (step.observation, step.info["tool_calls"], step.info["tool_errors"]) == (str(48213 * 907 + 5511), 1, 0)

    fmt = episode_host.observation_format(config, tok)
    fed, cut = fmt(step.observation)
    assert not cut
    drawn = ids(tok(action, add_special_tokens=False))
    conversation = prompt + [turn, {"role": "tool", "content": step.observation}]
    whole = ids(tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=True))
    assert ids(tok(prompt_text, add_special_tokens=False)) + drawn + fed == whole
    final = env.step(f"The answer is \\boxed{{{step.observation}}}.")
    assert final.done and final.reward == {"answer": 1.0}


def test_a_tools_section_that_teaches_another_call_format_stops_in_one_line(qwen):
    name, tok = qwen
    text_calls = json.dumps({"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"})
    with pytest.raises(ValueError) as err:
        episode_host.check_episodes(env_config(params=text_calls), tok)
    message = str(err.value)
    assert "\n" not in message and message.startswith("config.env.template_tools=True (config.env.name='calc')")
    assert "'</calc>'" in message and "config.env.template_tools=False" in message
    assert episode_host.prompt_tools(env_config(params=text_calls, template_tools=False), tok) is None

    already = [{"role": "user", "content": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}]
    for prompt, style in (("a rendered prompt", "auto"), (already, "auto"), (already, "template")):
        with pytest.raises(ValueError, match="data.prompt_style=messages"):
            render_prompt(prompt, tok, style, load_environment("calc").tools)
    assert "# Tools" in render_prompt("a question", tok, "messages", load_environment("calc").tools)


def test_the_warm_starts_traces_are_rendered_as_the_runs_prompts(qwen, tmp_path):
    """With a template whose tools section teaches the environment's calls, the warm start's traces
    carry the schemas (``tools``) and its prompts the answer's form alone: SFT renders each trace's
    prompt as the RL run renders its prompts, transformers' ``tools=`` rendering token for token."""
    from arlopti_jax.finetune import tool_traces
    from arlopti_jax.finetune.supervised import read_pairs, tokenize_pairs

    name, tok = qwen
    factory = load_environment("calc")
    tools = tool_traces.template_tools(tok, factory)
    assert tools == factory.tools
    assert tool_traces.template_tools(tok, load_environment("calc", {"call_style": "text", "call_open": "<calc>",
                                                                      "call_close": "</calc>"})) is None
    train, test = calc.generate(12, 2, seed=5)
    fmt = episode_host.observation_format(env_config(observation_tokens=64), tok)
    sft, train_file = tool_traces.write_start_point_data(tmp_path, train, test, tool_traces.NO_TOOL, 4, 0, factory,
                                                         fmt, True, tools)
    pairs = read_pairs([str(sft)])
    assert all(p["tools"] == tools for p in pairs)
    data = tokenize_pairs(pairs, tok, 4096)
    for i, pair in enumerate(pairs):
        prompt = ids(tok.apply_chat_template(pair["prompt"], tools=tools, add_generation_prompt=True))
        assert data["input_ids"][i][:len(prompt)].tolist() == prompt and not data["loss_mask"][i][:len(prompt)].any()
    rl = run_setup.prompt_dataset(env_config(), [train_file], tok).rows
    assert all(r["prompt_text"].startswith(f"<|im_start|>system\n{tool_traces.NO_TOOL}\n\n# Tools") for r in rl)


def test_a_template_without_tools_gets_no_tools_section(tmp_path):
    from task_fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    assert episode_host.prompt_tools(env_config(observation_format="\n<o>{observation}</o>\n"), tok) is None
    with pytest.raises(ValueError, match="^config.env.observation_format is empty and the model's chat template has no "
                                         "tool support"):
        episode_host.check_episodes(env_config(), tok)


def test_an_empty_observation_format_without_tool_support_stops_before_the_run_folder(start_point, tmp_path):
    """The embedded start point's template has no tools: ``env.name`` with an empty
    ``env.observation_format`` stops ``train`` (ARLOPTI_STARTUP_CHECK=1 and not) and ``eval`` at
    start-up with one ``error:`` line, and ``run_dir`` is never made; with the field set the check
    passes, and makes nothing either."""
    values = overrides(start_point, tmp_path / "run", **{
        "env.name": "calc", "env.turn_tokens": 8, "env.observation_tokens": 40, "rollout.max_response_length": 128,
        "data.max_prompt_length": 400, "data.test_files": str(start_point / "data")})

    def run(command: str, check: str, *extra: str):
        args = cli(values)
        args[2] = f"arlopti_jax.{command}"
        return subprocess.run(args + list(extra), capture_output=True, text=True, timeout=600,
                              env={**os.environ, STARTUP_CHECK_ENV: check, "XLA_FLAGS": ""})

    for command, check in (("train", "1"), ("train", "0"), ("eval", "1")):
        proc = run(command, check)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert errors[0].startswith("error: config.env.observation_format is empty and the model's chat template "
                                    "has no tool support")
        assert "start-up check passed" not in proc.stdout and not (tmp_path / "run").exists()
    passed = run("train", "1", "--config.env.observation_format=\n<o>{observation}</o>\n")
    assert passed.returncode == 0 and "start-up check passed" in passed.stdout, passed.stderr[-3000:]
    assert not (tmp_path / "run").exists()
