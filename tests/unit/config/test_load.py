"""Config composition (Hydra compose, as the app does) and validation messages."""

from dataclasses import fields

import pytest
from hydra.errors import ConfigCompositionException

from pipespec_mpi.config import (
    AppConfig,
    ConfigError,
    DecodeConfig,
    RunConfig,
    SamplingConfig,
    StageConfig,
    TinyBaseConfig,
    TokenizerConfig,
    TransportConfig,
    compose_config,
    validate,
)
from pipespec_mpi.data.config import DatasetConfig


def test_the_composed_default_is_the_dataclass_defaults():
    c = compose_config()
    defaults = {f.name: f.default for f in fields(AppConfig) if f.name not in ("hierarchy",)}
    assert c.method == defaults["method"] == "online"
    assert c.decode == DecodeConfig()
    # conf/dataset/humaneval.yaml names the dataset, its benchmark sample (4 prompts, shuffled) and
    # how a long prompt is cut
    assert c.dataset == DatasetConfig(n_prompts=4, shuffle=True, truncate="left")
    assert c.run == RunConfig()
    assert c.sampling == SamplingConfig()
    assert c.transport == TransportConfig()
    assert c.hierarchy.tiny == TinyBaseConfig() and c.hierarchy.name == "smollm2"


def test_hierarchy_files_hold_only_what_differs():
    c = compose_config(["hierarchy=tiny"])
    assert c.hierarchy.tokenizer == TokenizerConfig()
    assert c.hierarchy.stages[2] == StageConfig("tiny-target-4L", "tiny", layers=4, dtype="float64")


def test_overrides_reach_their_components_by_their_path():
    c = compose_config(["method=sd", "decode.lookahead=4", "decode.max_new_tokens=12", "dataset.n_prompts=2",
                        "transport.kind=gloo", "hierarchy=tiny2", "dataset=news", "run.mode=benchmark",
                        "run.methods=[ar,pipespec]", "dataset.seed=7", "sampling.seed=3"])  # fmt: skip
    assert (c.method, c.decode.lookahead, c.decode.max_new_tokens) == ("sd", 4, 12)
    assert c.dataset.n_prompts == 2 and c.dataset.name == "news" and c.dataset.seed == 7
    assert c.transport.kind == "gloo" and c.hierarchy.n_stages == 2 and c.sampling.seed == 3
    assert c.run.mode == "benchmark" and c.run.methods == ("ar", "pipespec")


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        compose_config(["decode.lookahead=-1", "decode.max_new_tokens=0", "transport.depth=0",
                        "dataset.n_prompts=0", "run.stall_timeout_s=0"])  # fmt: skip
    msg = str(err.value)
    for needle in ("decode.lookahead=-1", "decode.max_new_tokens=0", "transport.depth=0",
                   "dataset.n_prompts=0", "run.stall_timeout_s=0"):  # fmt: skip
        assert needle in msg
    assert len(err.value.problems) == 5


@pytest.mark.parametrize(
    "override,allowed",
    [("transport.kind=carrier_pigeon", "auto, mpi, gloo, nccl, strict"),
     ("run.cpu_bind=numa", "auto, always, none"), ("run.methods=[ar,beam]", "ar, sd, pipespec"),
     ("hierarchy.stages.0.dtype=fp8", "float32, float64"),
     ("dataset.truncate=middle", "left, right"), ("decode.policy=Static", "static, adaptive")],
)  # fmt: skip
def test_a_choice_is_taken_from_its_type_while_composing(override, allowed):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config([override])
    assert allowed in str(err.value.__cause__)


def test_choices_of_a_config_built_in_python_are_named_at_once():
    c = compose_config(["hierarchy=tiny"])
    c.transport = TransportConfig(kind="carrier_pigeon")
    c.run = RunConfig(cpu_bind="numa", methods=("ar", "beam"))
    c.hierarchy.stages = (StageConfig("t", "tiny", dtype="fp8"), *c.hierarchy.stages[1:])
    assert validate(c) == [
        "hierarchy.stages[0].dtype='fp8': must be one of float32, float64, float16, bfloat16",
        "transport.kind='carrier_pigeon': must be one of auto, mpi, gloo, nccl, strict",
        "run.methods='beam': must be one of ar, sd, pipespec, online",
        "run.cpu_bind='numa': must be one of auto, always, none",
    ]
    # the values are the enumerations' members, equal to their names as strings
    c = compose_config(["transport.kind=gloo", "run.methods=[sd]"])
    assert c.transport.kind == "gloo" and f"{c.transport.kind}" == "gloo" and c.run.methods == ("sd",)


def test_sd_needs_a_window():
    with pytest.raises(ConfigError, match="method=sd"):
        compose_config(["method=sd", "decode.lookahead=0", "decode.sd_window=null"])
    with pytest.raises(ConfigError, match="run.mode=benchmark"):
        compose_config(["run.mode=benchmark", "decode.lookahead=0", "decode.sd_window=null"])
    with pytest.raises(ConfigError, match="decode.sd_window=0"):
        compose_config(["decode.sd_window=0"])


def test_sd_window_is_separate_from_pipespec_lookahead():
    d = compose_config(["run.mode=benchmark", "decode.lookahead=0", "decode.sd_window=3"]).decode
    assert (d.window("pipespec"), d.window("sd"), d.window("ar")) == (0, 3, 0)
    d = compose_config(["decode.lookahead=4", "decode.sd_window=null"]).decode
    assert d.window("sd") == d.window("pipespec") == 4


@pytest.mark.parametrize(
    "override",
    ["lookahed=3", "lookahead=3", "mode=benchmark", "hierarchy.stages.0.layerz=2", "decode.lookahead=two"],
)
def test_unknown_keys_and_wrong_types_are_rejected_while_composing(override):
    with pytest.raises(ConfigCompositionException):
        compose_config([override])


@pytest.mark.parametrize(
    "override,needle",
    [("+run.typo_key=1", "run.typo_key"), ("+hierarchy.stages.0.layerz=2", "stages[0].layerz")],
)
def test_keys_added_with_plus_are_rejected_too(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        compose_config([override])


def test_a_required_file_is_named():
    with pytest.raises(ConfigError, match="dataset.path"):
        compose_config(["dataset=jsonl"])


def test_prompt_lookup_only_heads_a_hierarchy():
    c = compose_config(["hierarchy=tiny"])
    c.hierarchy.stages = (c.hierarchy.stages[0], StageConfig("pl", "prompt_lookup"), c.hierarchy.stages[2])
    assert any("only be stage 0" in p for p in validate(c))


def test_a_random_stage_names_a_known_shape():
    c = compose_config(["hierarchy=random_llama3"])
    assert [st.shape for st in c.hierarchy.stages] == [None, "1B", "8B"]
    c.hierarchy.stages = (c.hierarchy.stages[0], StageConfig("r", "random", shape="9B"))
    assert any(
        "stages[1] (r).shape='9B': required for kind=random, one of toy, 135M" in p for p in validate(c)
    )


def test_a_config_error_survives_pickling_with_its_problems():
    """hierarchy=auto finds some problems on rank 0 and broadcasts the error to every rank."""
    import pickle

    err = ConfigError(["auto.replicas=2 does not divide the world size 3"])
    err.collective = True
    back = pickle.loads(pickle.dumps(err))
    assert back.problems == err.problems and str(back) == str(err) and back.collective


def test_batch_sizes_are_checked_with_their_keys():
    assert compose_config(["decode.batch_size=4"]).decode.batch_size == 4
    c = compose_config(["run.mode=benchmark", "run.batch_sizes=[1,2,4]"])
    assert c.run.batch_sizes == (1, 2, 4)
    with pytest.raises(ConfigError) as err:
        compose_config(["decode.batch_size=0", "run.batch_sizes=[2,0]"])
    msg = str(err.value)
    assert "decode.batch_size=0" in msg and "run.batch_sizes=[2, 0]" in msg and "run.mode=benchmark" in msg
    # batched over NCCL: one link per pair, the slot in each message (comm/mux.py)
    assert compose_config(["decode.batch_size=2", "transport.kind=nccl"]).transport.kind == "nccl"


def test_a_batched_stage_verifies_within_its_row_budget():
    d = DecodeConfig(policy="static", batch_verify_rows=16)  # max_verify 16
    assert d.for_batch(1) is d
    assert [d.for_batch(b).max_verify for b in (2, 4, 8, 16)] == [7, 3, 1, 1]
    assert DecodeConfig(batch_verify_rows=None, policy="static").for_batch(8).max_verify == 16
    assert DecodeConfig(max_verify=2, policy="static").for_batch(2).max_verify == 2
    assert DecodeConfig().for_batch(8).max_verify == 16  # adaptive: the slots share the rows instead
    with pytest.raises(ConfigError, match="decode.batch_verify_rows=1"):
        compose_config(["decode.batch_verify_rows=1"])


def test_a_tuning_recipe_is_a_preset_not_a_default():
    assert compose_config().decode.batch_verify_rows is None  # the schema's: rows verified as held
    c = compose_config(["tuning=cpu_few_cores"])
    assert c.decode == DecodeConfig(batch_verify_rows=16)  # the recipe's one change
    mine = compose_config(["tuning=cpu_few_cores", "decode.batch_verify_rows=8"])  # an override wins
    assert mine.decode.batch_verify_rows == 8
