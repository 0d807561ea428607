"""Config composition (Hydra compose, as the app does) and validation messages."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipespec_mpi.config import ConfigError, load_config

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def typed(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return load_config(OmegaConf.to_container(cfg, resolve=False))


def test_default_composes():
    c = typed()
    assert c.hierarchy.n_stages == 3
    assert c.method.name == "pipespec" and c.decode.lookahead == 0 and c.decode.max_run_ahead == 8
    assert c.decode.window("sd") == 2


def test_overrides_reach_their_components():
    c = typed("method=sd", "lookahead=4", "max_new_tokens=12", "n_prompts=2", "transport=gloo",
              "hierarchy=tiny2", "dataset=news", "mode=benchmark")  # fmt: skip
    assert (c.method.name, c.decode.lookahead, c.decode.max_new_tokens) == ("sd", 4, 12)
    assert c.dataset.n_prompts == 2 and c.dataset.name == "news"
    assert c.transport.kind == "gloo" and c.hierarchy.n_stages == 2
    assert c.run.mode == "benchmark" and c.run.methods == ("ar", "sd", "pipespec")


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        typed("lookahead=-1", "max_new_tokens=0", "transport=carrier_pigeon", "n_prompts=0")
    msg = str(err.value)
    for needle in ("lookahead=-1", "max_new_tokens=0", "carrier_pigeon", "n_prompts=0"):
        assert needle in msg
    assert len(err.value.problems) >= 4


def test_sd_needs_a_window():
    with pytest.raises(ConfigError, match="method=sd"):
        typed("method=sd", "lookahead=0", "decode.sd_window=null")
    with pytest.raises(ConfigError, match="mode=benchmark"):
        typed("mode=benchmark", "lookahead=0", "decode.sd_window=null")
    with pytest.raises(ConfigError, match="decode.sd_window=0"):
        typed("decode.sd_window=0")


def test_sd_window_is_separate_from_pipespec_lookahead():
    d = typed("mode=benchmark", "lookahead=0", "decode.sd_window=3").decode
    assert (d.window("pipespec"), d.window("sd"), d.window("ar")) == (0, 3, 0)
    d = typed("lookahead=4", "decode.sd_window=null").decode
    assert d.window("sd") == d.window("pipespec") == 4


def test_unknown_keys_are_errors():
    with pytest.raises(ConfigError, match="lookahed"):
        load_config({**OmegaConf.to_container(_raw()), "lookahed": 3})
    raw = OmegaConf.to_container(_raw())
    raw["hierarchy"]["stages"][0]["layerz"] = 2
    with pytest.raises(ConfigError, match=r"stages\[0\]\.layerz"):
        load_config(raw)


def test_unknown_override_is_rejected_by_hydra():
    with pytest.raises(Exception, match="lookahed"):
        typed("lookahed=3")


def test_prompt_lookup_only_heads_a_hierarchy():
    raw = OmegaConf.to_container(_raw())
    raw["hierarchy"]["stages"][1] = {"name": "pl", "kind": "prompt_lookup"}
    with pytest.raises(ConfigError, match="only be stage 0"):
        load_config(raw)


def _raw():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config")
