"""``aot`` takes a run's shapes from what the run would read: the embedded default's start point
once it is built (its vocabulary, its data's longest prompt), the declared shape before that,
and never builds the start point itself."""

import json

from transformers import AutoTokenizer

from arlopti_jax.aot import shapes
from arlopti_jax.aot.check import data_prompt_width
from arlopti_jax.embedded.default import get_config
from arlopti_jax.tasks.data import load_rows, render_prompt


def _default_beside(folder):
    config = get_config()
    config.run_dir = str(folder / "run")  # the start point is looked for in run_dir's parent
    return config


def test_the_default_takes_its_start_points_shapes_once_built(start_point, tmp_path):
    built, bare = tmp_path / "built", tmp_path / "bare"
    built.mkdir()
    bare.mkdir()
    (built / "start_point").symlink_to(start_point)

    cfg, _, _, source = shapes.for_config(_default_beside(built))
    model = json.loads((start_point / "model" / "config.json").read_text())
    assert source.endswith("start_point/model/config.json") and cfg.vocab_size == model["vocab_size"]
    # the longest prompt of its training and test files, tokenized here with the model's tokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(start_point / "model"))
    files = [start_point / "data" / name for name in ("train.parquet", "test_2ppl.parquet", "test_3ppl.parquet")]
    longest = max(len(tokenizer(render_prompt(row["prompt"], tokenizer), add_special_tokens=False)["input_ids"])
                  for f in files for row in load_rows([f]))
    assert data_prompt_width(_default_beside(built)) == longest

    cfg, _, _, source = shapes.for_config(_default_beside(bare))  # not built: the declared shape
    assert "before it is built" in source and cfg.vocab_size == 1024
    assert data_prompt_width(_default_beside(bare)) == 0
    assert list(bare.iterdir()) == []  # nothing was built
