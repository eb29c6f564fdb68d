"""The embedded default's end-of-run summary: chance levels per test set and the training
reward's trend statistic, checked against hand computations."""

import numpy as np
import pytest

from arlopti_jax.tasks.kk import guess_accuracy
from arlopti_jax.rl.summary import chance_levels, reward_trend


def test_guess_accuracy_from_the_people_count():
    assert guess_accuracy("kk_logic2") == 0.25
    assert guess_accuracy("kk_logic3") == 0.125
    assert guess_accuracy("kk_logic") is None  # the public data's value does not name n
    assert guess_accuracy("math_dsr") is None


def test_chance_levels_average_the_rows():
    class Data:
        def __init__(self, sources):
            self.rows = [{"data_source": s} for s in sources]

    got = chance_levels({"a": Data(["kk_logic2"] * 3), "mixed": Data(["kk_logic2", "kk_logic3"]),
                         "math": Data(["kk_logic2", "math_dsr"])})
    assert got == {"a": 0.25, "mixed": pytest.approx(0.1875), "math": None}


def test_reward_trend_in_standard_errors():
    rewards = [0.0, 1.0, 0.0, 1.0, 5.0, 5.0, 2.0, 4.0, 3.0, 3.0, 3.0, 5.0]
    first, last, z = reward_trend(rewards)
    # quarters of 3 steps: [0, 1, 0] and [3, 3, 5]
    se = np.sqrt(np.var([0, 1, 0], ddof=1) / 3 + np.var([3, 3, 5], ddof=1) / 3)
    assert (first, last) == (pytest.approx(1 / 3), pytest.approx(11 / 3))
    assert z == pytest.approx((11 / 3 - 1 / 3) / se)
    assert reward_trend([1.0] * 7) is None  # too few steps for two quarters of 2


@pytest.mark.parametrize("backend, numerics", [
    ("cpu", dict(dtype="float32", param_dtype="float32", attention="auto", remat=False, unroll_layers=True)),
    ("gpu", dict(dtype="bfloat16", param_dtype="float32", attention="cudnn", remat=False, unroll_layers=True)),
    ("tpu", dict(dtype="bfloat16", param_dtype="float32", attention="xla", remat=False, unroll_layers=True)),
])
def test_the_default_numerics_follow_the_backend(monkeypatch, backend, numerics):
    """The embedded default under a faked backend: on the CPU exactly the values its accuracy gain was
    measured with; on a GPU or TPU bfloat16 compute on float32 weights (cuDNN's attention on a GPU).
    Nothing else differs, and each is a valid config for its platform."""
    from arlopti_jax.config import DEFAULT_CONFIG, load_config_file, validate
    from arlopti_jax.runtime import chips

    monkeypatch.setattr(chips, "backend", lambda: backend)
    c = load_config_file(DEFAULT_CONFIG)
    assert {k: c.model[k] for k in numerics} == numerics
    validate(c, 1, backend)
    monkeypatch.setattr(chips, "backend", lambda: "cpu")
    cpu = load_config_file(DEFAULT_CONFIG)
    cpu.model.update(numerics)
    assert cpu == c
