"""The warm start of tool use: supervised traces that teach a small model the tool-call format.

    python -m arlopti_jax.finetune.tool_traces --model models/smollm2-135m --out runs/calc_tool \\
        --env-params '{"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"}' \\
        --observation-format '\\n<output>{observation}</output>\\n'
    python -m arlopti_jax.finetune.tool_traces --model models/smollm2-135m --out runs/calc_notool --no-tool

writes ``OUT/data/train.parquet`` and ``test_calc.parquet`` (``tasks.calc``'s problems, the RL
prompts), ``OUT/data/sft.jsonl`` (the traces) and ``OUT/model``, the model fine-tuned on them
(``supervised.run_sft``): the start point of an RL run on ``calc``, with the tool or without it.

With the tool, a problem's trace is three segments: the call (``<calc>EXPRESSION</calc>`` in the
environment's text style, or Qwen's ``<tool_call>`` JSON), ending at the environment's stop
string as the sampler's turns do; the observation, the calculator's real output formatted as the
episodes format it (``rollout.observations.ObservationFormat``: the same text, so the same ids),
not trained; and ``The answer is \\boxed{VALUE}.`` and the EOS. Without the tool (the baseline's
warm start) it is the last segment alone. Both arms' prompts are a system message and the question,
no worked example: the tool arm's system message is the environment's ``instructions`` (how to
call the tool, and the answer's form), the baseline's says the answer's form alone
(``NO_TOOL``), so the two differ by the tool and nothing else. With a chat template whose tools
section teaches the environment's call format (Qwen2.5's, Qwen3's with the default JSON calls) the
tool arm's prompts are rendered as the RL run renders them (``env.template_tools``): the answer's
form in the system message, the template's tools section from the environment's schemas (the
traces' ``tools`` column; ``rl/episode_host.prompt_tools`` adds it to the RL prompts). The first ``--sft-rows`` training
problems (after a seeded shuffle) are the traces' and are left out of ``train.parquet``, so RL
never trains on a problem whose answer the warm start showed.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import argparse
import json
import random
import sys
from pathlib import Path

NO_TOOL = "Give the final answer as \\boxed{ANSWER}."
ANSWER = "The answer is \\boxed{{{value}}}."


def prompt_messages(question: str, system: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def tool_call(env, expression: str) -> str:
    """A call of a ``ToolEnvironment``'s tool on ``expression``, in its call format."""
    fmt = env.format
    if fmt.style == "json":
        body = json.dumps({"name": env.tool_name, "arguments": {env.argument: expression}})
        return f"{fmt.open}\n{body}\n{fmt.close}"
    return f"{fmt.open}{expression}{fmt.close}"


def trace(row: dict, factory, observations, tool: bool) -> list[dict]:
    """One problem's response segments (module docstring); ``observations``: the episodes'
    ``ObservationFormat``."""
    answer = {"text": ANSWER.format(value=row["reward_model"]["ground_truth"]), "train": True}
    if not tool:
        return [answer]
    env = factory()
    env.reset(row)
    call = tool_call(env, row["extra_info"]["expression"])
    step = env.step(call)
    if step.observation is None or step.info.get("tool_errors"):
        raise ValueError(f"the tool did not answer the trace's call {call!r}: {step}")
    return [{"text": call, "train": True}, {"text": observations.text(step.observation), "train": False}, answer]


def template_tools(tokenizer, factory) -> list[dict] | None:
    """The environment's schemas where the chat template writes a tools section that teaches its
    call format (as the RL run's prompts get it), else None: the system message must say it."""
    from arlopti_jax.rollout.observations import template_supports_tools, tools_section_problem

    if not (factory.tools and factory.stop_strings and template_supports_tools(tokenizer)):
        return None
    return factory.tools if tools_section_problem(tokenizer, factory.tools, factory.stop_strings[0]) is None else None


def write_start_point_data(folder: Path, train: list[dict], test: list[dict], system: str, sft_rows: int,
                           seed: int, factory, observations, tool: bool,
                           tools: list[dict] | None = None) -> tuple[Path, Path]:
    """OUT/data: train.parquet and test_calc.parquet (the prompts, ``system`` first), sft.jsonl (the
    first ``sft_rows`` shuffled training problems' traces, with ``tools`` where given). Returns
    (sft.jsonl, train.parquet)."""
    from arlopti_jax.tasks import calc

    def with_prompt(row):
        return {**row, "prompt": prompt_messages(row["extra_info"]["question"], system)}

    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    if not 0 < sft_rows < len(train):
        raise ValueError(f"--sft-rows {sft_rows}: the training set has {len(train)} problems")
    sft = [with_prompt(train[i]) for i in order[:sft_rows]]
    data = folder / "data"
    calc.write_parquet([with_prompt(train[i]) for i in sorted(order[sft_rows:])], data / "train.parquet")
    calc.write_parquet([with_prompt(r) for r in test], data / "test_calc.parquet")
    lines = [json.dumps({"prompt": row["prompt"], "response": trace(row, factory, observations, tool),
                         **({"tools": tools} if tools else {})}) for row in sft]
    (data / "sft.jsonl").write_text("\n".join(lines) + "\n")
    return data / "sft.jsonl", data / "train.parquet"


def build(out: Path, model: Path, *, tool: bool, env: str = "calc", env_params: dict | None = None,
          observation_format: str = "", observation_tokens: int = 64, train_count: int = 2000,
          test_count: int = 128, sft_rows: int = 256, steps: int = 80, batch: int = 16, lr: float = 5e-5,
          seed: int = 0) -> Path:
    """The start point in ``out`` (module docstring); its model folder ``out/model``."""
    import jax
    from transformers import AutoTokenizer

    from arlopti_jax.finetune.supervised import read_pairs, run_sft
    from arlopti_jax.models import load_pretrained, save_pretrained
    from arlopti_jax.rollout.observations import ObservationFormat
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.tasks import calc
    from arlopti_jax.tasks.envs import load_environment

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    factory = load_environment(env, env_params or {}, field="--env")
    observations = ObservationFormat(tokenizer, observation_format, observation_tokens,
                                     where="--observation-format") if tool else None
    tools = template_tools(tokenizer, factory) if tool else None
    if tool:
        print("tool traces: " + ("the chat template's tools section, the answer's form in the system message" if tools
                                 else "the environment's instructions in the system message"), file=sys.stderr)
    train, test = calc.generate(train_count, test_count, seed=seed)
    system = factory.instructions if tool and not tools else NO_TOOL
    sft_file, _ = write_start_point_data(out, train, test, system, sft_rows, seed, factory, observations, tool, tools)
    mesh = shd.make_mesh({"fsdp": -1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(model, mesh=mesh, dtype="float32", param_dtype="float32", remat=False)
    params, losses = run_sft(cfg, params, tokenizer, read_pairs([str(sft_file)]), steps=steps, batch=batch, lr=lr,
                             warmup=max(1, steps // 10), max_length=512, seed=seed, mesh=mesh,
                             desc="tool traces (sft)" if tool else "answers (sft)")
    save_pretrained(cfg, params, out / "model", tokenizer_dir=model)
    (out / "warm_start.json").write_text(json.dumps({"tool": tool, "env": env, "env_params": env_params or {},
                                                     "observation_format": observation_format, "steps": steps,
                                                     "loss_first": losses[0], "loss_last": losses[-1]}) + "\n")
    return out / "model"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arlopti_jax.finetune.tool_traces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the Hugging Face folder to warm-start")
    p.add_argument("--out", required=True, help="the start point's folder (data/ and model/ inside)")
    p.add_argument("--no-tool", action="store_true", help="the baseline's warm start: answers without the tool")
    p.add_argument("--env", default="calc", help="the environment (a ToolEnvironment: its tool and call format)")
    p.add_argument("--env-params", default="{}", help="its parameters, a JSON object (the run's env.params)")
    p.add_argument("--observation-format", default="", help="the run's env.observation_format")
    p.add_argument("--observation-tokens", type=int, default=64, help="the run's env.observation_tokens")
    p.add_argument("--sft-rows", type=int, default=256, help="training problems given as traces")
    p.add_argument("--steps", type=int, default=80, help="SFT optimizer steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        params = json.loads(args.env_params)
        if not isinstance(params, dict):
            raise ValueError("not a JSON object")
        model = build(Path(args.out), Path(args.model), tool=not args.no_tool, env=args.env, env_params=params,
                      observation_format=args.observation_format, observation_tokens=args.observation_tokens,
                      sft_rows=args.sft_rows, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"warm start written to {model}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
