"""What a run compiles is what ``aot --target=local`` lists: the packed passes' programs of every
shape of the run's set, compiled with the first batch, and nothing more for the packed passes over
later batches of other lengths; the sampler's programs at the run's one prompt width, whatever the
longest prompt of each batch, all of them (every row bucket and phase of the length-aware schedule,
the evaluation's) compiled before the first step, so that nothing compiles after it."""

import collections
import re

import pytest
from run_fixtures import make_config, overrides

from arlopti_jax.aot import targets
from arlopti_jax.aot.check import check
from arlopti_jax.rl import run_setup
from arlopti_jax.rl.loop import train
from arlopti_jax.rollout.sampling import bucket
from arlopti_jax.runtime import compiles

PACKED = {"jit(accumulate)": "accumulate", "jit(logprobs)": "log-probs"}
SAMPLER = ("prefill", "start", "decode", "compact", "grow", "scatter")


def _decode_loops(records) -> set[tuple[int, int]]:
    """(rows, cache slots) of each compiled decode loop: its state's kv_mask [rows, slots] is the first
    2-D int32 argument (after the float32 weights and KV cache)."""
    return {tuple(int(v) for v in re.search(r"int32\[(\d+),(\d+)\]", r.shapes).groups())
            for r in records if r.name == "jit(decode)"}


def test_length_aware_rollouts_and_a_first_evaluation_after_step_one_compile_nothing_after_it(start_point,
                                                                                               tmp_path):
    """The length-aware schedule's every row bucket and phase, and an evaluation first run after the
    first step (``train.eval_before=False``), are compiled by the warm-up: nothing compiles after the
    first step, and every decode loop the schedule can reach was compiled, met or not. Before the
    warm-up the evaluation's programs (and the checkpoint's) compiled after the first step, and a row
    bucket met first at a later step compiled there."""
    values = overrides(start_point, tmp_path / "run", **{
        "train.max_steps": 1, "rollout.length_aware": True,
        "rollout.phase_tokens": 6, "rollout.min_rows": 2,  # phases of 6 and 12 slots; 4 rows per device, then 2
        "data.test_files": str(start_point / "data" / "test_2ppl.parquet"), "train.eval_before": False,
        "train.eval_max_prompts": 2,
        "train.pack_row_lengths": 1, "train.pack_fills": 1, "loss.kl_coef": 0.0})  # few packed programs
    log = compiles.watch()
    mark = log.programs
    summary = train(make_config(values))
    records = log.since(mark)
    programs, _, late = summary["compile"]
    assert late == 0, [(r.name, r.shapes[:200]) for r in records[programs - late:]]
    assert programs == len(records)
    inputs = run_setup.prepare_inputs(make_config(values))
    slots = [bucket(inputs.longest_prompt, 64) + end for end in (6, 12)]
    # 8 fake devices: the rollout's 4 prompts (8 rows, a multiple of the devices) x 4 samples, 4 rows per
    # device and 2 after a compaction; the evaluation's 2 prompts padded to 8 rows, one sample, 1 per device
    assert _decode_loops(records) == {(rows, s) for rows in (32, 16, 8) for s in slots}


def _rows_by_length(shapes: str) -> str:
    """A packed program's micro-batch shape from its argument list: the first 2-D int32 array of
    the micro-batch (its arguments come after the float32 parameters) is input_ids, [rows, length]."""
    rows, length = re.search(r"int32\[(\d+),(\d+)\]", shapes).groups()
    return f"{rows}x{length}"


@pytest.mark.slow  # about 2 minutes on 2 cores: aot compiles the run's programs, then 4 RL steps
def test_train_compiles_the_programs_aot_lists(start_point, tmp_path):
    # 1,280 tokens per device: rows of two lengths (twice the longest sequence, then half; multiples of 16 on the CPU)
    # prompt widths bucketed by 8 tokens: the start point's prompts (81-111 tokens) span 4 buckets, so
    # batches of 4 prompts have longest prompts in different buckets
    # the length-aware sampler: phases of 8 and 16 slots, 4 rows per device then 2 (11 programs)
    values = overrides(start_point, tmp_path / "run", **{"train.max_steps": 4, "train.save_every": 100,
                                                          "rollout.max_response_length": 16, "rollout.n": 4,
                                                          "train.max_tokens_per_micro_batch": 1280,
                                                          "train.pack_row_lengths": 2, "rollout.prompt_bucket": 8,
                                                          "rollout.length_aware": True, "rollout.phase_tokens": 8,
                                                          "rollout.min_rows": 2})
    log = compiles.watch()
    mark = log.programs
    summary = train(make_config(values))  # first: a program it lists here would be in JAX's caches already
    records = log.since(mark)
    record = check(make_config(values), targets.get("local"), groups=("rollout", "logprobs", "update"))
    listed = sorted(p["name"] for p in record["programs"] if p["name"].split()[0] in PACKED.values())
    assert any(name.startswith("log-probs") for name in listed) and len(listed) == 10, listed
    width = record["batch"]["prompt_slots"]
    sampler_listed = collections.Counter(p["name"].split()[0] for p in record["programs"] if p["group"] == "rollout")

    batches = run_setup.prepare_inputs(make_config(values)).iterator  # the run's 4 batches
    data_longest = max(len(row["prompt_ids"]) for row in batches.dataset.rows)
    assert width == -(-data_longest // 8) * 8  # under 128: the multiple of 8, not the power of two
    longest = {max(len(row["prompt_ids"]) for row in next(batches)) for _ in range(4)}
    assert len({-(-n // 8) for n in longest}) > 1, longest  # alone, they would take several prompt widths

    compiled = sorted(f"{PACKED[r.name]} {_rows_by_length(r.shapes)}" for r in records if r.name in PACKED)
    assert compiled == listed  # each listed program once, none other

    # the sampler: one prefill, at the width aot lists (the data's longest prompt's), whatever each
    # batch's longest prompt; every program aot lists (the warm-up's), each once, met or not
    prefills = [r.shapes for r in records if r.name == "jit(prefill)"]
    assert [_rows_by_length(shapes).split("x")[1] for shapes in prefills] == [str(width)], prefills
    sampler_compiled = collections.Counter(r.name[4:-1] for r in records if r.name[4:-1] in SAMPLER)
    assert sampler_compiled == sampler_listed and sampler_listed["compact"] == 2, (sampler_compiled, sampler_listed)
    programs, seconds, late = summary["compile"]  # the summary counts what the log holds
    assert programs == len(records) and seconds == pytest.approx(sum(r.seconds for r in records))
    assert late == 0
