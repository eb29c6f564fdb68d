"""Config validation takes its choice lists from the code that implements them: an advantage
estimator or token weighting registered in ``algos`` is a valid config value, the KL estimators'
aliases are accepted as LossConfig accepts them, --help lists every allowed value, and the
CISPO-with-GSPO-ratio conflict is one rule, stated alike by config validation and LossConfig."""

import pytest

from arlopti_jax import algos
from arlopti_jax.algos import advantages, token_weights
from arlopti_jax.config import ConfigError, base_config, choices, validate
from arlopti_jax.config.cli import help_text
from arlopti_jax.train import COMMAND


def with_value(field: str, value):
    c = base_config()
    group, leaf = field.split(".")
    c[group][leaf] = value
    return c


def test_registered_methods_are_valid_config_values():
    @algos.register_advantage_estimator("test_only_estimator")
    def _est(cfg, rewards, group_ids, mask):
        return rewards

    @algos.register_token_weighting("test_only_weighting")
    def _w(cfg, p):
        return p

    try:
        validate(with_value("algo.adv_estimator", "test_only_estimator"))
        validate(with_value("algo.weighting", "test_only_weighting"))
        assert "test_only_estimator" in choices()["algo.adv_estimator"]
    finally:
        advantages._ESTIMATORS.pop("test_only_estimator")
        token_weights._WEIGHTINGS.pop("test_only_weighting")
    with pytest.raises(ConfigError, match="config.algo.adv_estimator='test_only_estimator' is invalid"):
        validate(with_value("algo.adv_estimator", "test_only_estimator"))


@pytest.mark.parametrize("field, values", [
    ("algo.adv_estimator", ("grpo", "reinforce_plus_plus", "rloo", "dr_grpo")),
    ("algo.weighting", ("none", "ar", "tr")),
    ("loss.kl_type", ("k1", "kl", "k2", "mse", "k3", "low_var_kl")),
    ("loss.agg", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")),
    ("loss.mode", ("ppo", "cispo")),
    ("loss.ratio_level", ("token", "sequence")),
    ("optim.schedule", ("constant", "warmup_cosine")),
])
def test_every_value_the_algorithms_accept_is_a_valid_config_value(field, values):
    assert set(choices()[field]) == set(values)
    for value in values:
        c = with_value(field, value)
        if value == "warmup_cosine":
            c.optim.warmup_steps = 0
        validate(c)
    with pytest.raises(ConfigError, match=f"config.{field}='bogus' is invalid: allowed values are"):
        validate(with_value(field, "bogus"))


def test_help_lists_the_allowed_values():
    lines = help_text(COMMAND, []).splitlines()
    for field, allowed in choices().items():
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {field} = "))
        end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("      "))
        meaning = " ".join(line.strip() for line in lines[start + 1:end])
        assert f"[allowed: {', '.join(allowed)}]" in meaning, (field, meaning)


def test_cispo_with_the_sequence_ratio_is_one_rule():
    rule = algos.loss_mode_conflict("cispo", "sequence")
    assert rule and algos.loss_mode_conflict("ppo", "sequence") is None
    assert algos.loss_mode_conflict("cispo", "token") is None
    c = with_value("loss.mode", "cispo")
    c.loss.ratio_level = "sequence"
    with pytest.raises(ConfigError) as raised:
        validate(c)
    assert str(raised.value) == f"config.loss.ratio_level='sequence' is invalid: {rule}"
    with pytest.raises(ValueError) as raised:
        algos.LossConfig(mode="cispo", ratio_level="sequence")
    assert str(raised.value) == f"LossConfig.ratio_level='sequence': {rule}"


@pytest.mark.parametrize("field, value, others, rule", [
    ("attention", "cudnn", {"dtype": "bfloat16"}, "cuDNN's fused attention .* runs on"),
    ("decode_attention", "pallas", {}, "the Pallas decode kernel runs only on a GPU, and this runs on"),
    ("decode_matmul", "pallas", {}, "the Pallas decode products run only on a GPU, and this runs on"),
], ids=["attention", "decode_attention", "decode_matmul"])
def test_gpu_only_choices_are_checked_against_the_platform(field, value, others, rule):
    """A GPU-only setting is refused on a CPU or TPU (validate's platform: this machine's backend for
    train and eval, the target's for aot, which compiles GPU kernels for an H100 on a CPU machine);
    'auto' picks per backend by itself."""
    c = base_config()
    for name, v in {field: value, **others}.items():
        setattr(c.model, name, v)
    validate(c)  # no platform: not checked
    validate(c, 1, "gpu")
    for platform in ("cpu", "tpu"):
        with pytest.raises(ConfigError, match=rf"config.model.{field}='{value}' is invalid: {rule} {platform}"):
            validate(c, 1, platform)
    setattr(c.model, field, "auto" if field != "decode_matmul" else "xla")
    validate(c, 1, "cpu")


def test_the_fused_decode_products_need_the_pallas_attention():
    """model.decode_matmul=pallas runs only in the Pallas attention's decode steps."""
    c = base_config()
    c.model.decode_matmul, c.model.decode_attention = "pallas", "xla"
    with pytest.raises(ConfigError, match=r"config.model.decode_matmul='pallas' is invalid: .* need "
                                          r"model.decode_attention 'auto' or 'pallas'"):
        validate(c, 1, "gpu")
    c.model.decode_attention = "pallas"
    validate(c, 1, "gpu")
