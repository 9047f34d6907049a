"""Strict parsing of the graph YAML, command-line overrides and the dict round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from omnistage.configs.parse import (ConfigError, apply_overrides, from_dict, load_graph_yaml,
                                     to_dict)
from omnistage.configs.schema import (ARConfig, ARSettings, GenerationSettings, GraphConfig,
                                      KVCacheConfig, Placement, StageConfig, StageInput)
from omnistage.sampling_params import SamplingParams

DESIGN_YAML = """\
stages:
  - name: thinker
    kind: ar
    component: thinker            # which part of the checkpoint this stage loads
    final: text                   # this stage's text goes to the client
    placement:
      devices: [0]
      memory_fraction: 0.5
    ar:
      max_num_seqs: 64
      sampling: {temperature: 0.0, max_tokens: 2048}
  - name: talker
    kind: ar
    component: talker
    inputs: [{from: thinker, adapter: qwen3_omni.thinker_to_talker, chunked: true}]
    placement:
      devices: [0]
      memory_fraction: 0.2
    ar:
      sampling: {temperature: 0.9, top_k: 50, repetition_penalty: 1.05}
  - name: code2wav
    kind: generation
    component: code2wav
    inputs: [{from: talker, adapter: qwen3_omni.talker_to_code2wav, chunked: true}]
    final: audio
    placement:
      devices: [0]
      memory_fraction: 0.1
connector: shm                    # inproc | shm | tcp
"""


def design_dict() -> dict:
    return yaml.safe_load(DESIGN_YAML)


def error(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(GraphConfig, data)
    return str(info.value)


def with_stage(index: int, **changes: object) -> dict:
    data = design_dict()
    data["stages"][index].update(changes)
    return data


# ---- the design example ------------------------------------------------------------------------

def test_design_example_parses_into_the_expected_tree() -> None:
    graph = load_graph_yaml(DESIGN_YAML)
    assert graph == GraphConfig(stages=(
        StageConfig(name="thinker", kind="ar", component="thinker", final="text",
                    placement=Placement(devices=(0,), memory_fraction=0.5),
                    ar=ARSettings(max_num_seqs=64,
                                  sampling={"temperature": 0.0, "max_tokens": 2048})),
        StageConfig(name="talker", kind="ar", component="talker",
                    inputs=(StageInput("thinker", "qwen3_omni.thinker_to_talker", True),),
                    placement=Placement(memory_fraction=0.2),
                    ar=ARSettings(sampling={"temperature": 0.9, "top_k": 50,
                                            "repetition_penalty": 1.05})),
        StageConfig(name="code2wav", kind="generation", component="code2wav",
                    inputs=(StageInput("talker", "qwen3_omni.talker_to_code2wav", True),),
                    final="audio", placement=Placement(memory_fraction=0.1)),
    ), connector="shm")
    talker = graph.stage("talker")
    assert isinstance(talker.inputs, tuple) and isinstance(talker.placement.devices, tuple)
    assert talker.ar.max_num_seqs == 64 and talker.ar.kv_cache.block_size == 16  # defaults
    assert graph.stage("code2wav").generation == GenerationSettings()  # its kind's record
    assert graph.stage("code2wav").ar is None
    assert graph.backend == "process" and graph.model is None
    assert hash(graph) == hash(load_graph_yaml(DESIGN_YAML))


def test_stage_builds_its_default_sampling_and_ar_config() -> None:
    graph = load_graph_yaml(DESIGN_YAML)
    talker = graph.stage("talker")
    assert talker.default_sampling() == SamplingParams(temperature=0.9, top_k=50,
                                                       repetition_penalty=1.05)
    assert graph.stage("code2wav").default_sampling() == SamplingParams()

    cfg = graph.stage("thinker").ar_config("Qwen/Qwen3-Omni", "cpu")
    assert isinstance(cfg, ARConfig)
    assert (cfg.model, cfg.component, cfg.device) == ("Qwen/Qwen3-Omni", "thinker", "cpu")
    assert cfg.memory_fraction == 0.5 and cfg.scheduler.max_num_seqs == 64

    own = StageConfig(name="x", kind="ar", model="own/ckpt",
                      ar=ARSettings(kv_cache=KVCacheConfig(num_blocks=8), max_model_len=99,
                                    output_hidden_layers=[0, 24]))
    cfg = own.ar_config("graph/ckpt", "cuda:1")
    assert cfg.model == "own/ckpt" and cfg.kv_cache.num_blocks == 8
    assert cfg.scheduler.max_model_len == 99
    assert own.default_sampling().output_hidden_layers == (0, 24)
    with pytest.raises(ValueError, match="generation stage, not ar"):
        graph.stage("code2wav").ar_config("m", "cpu")


def test_int_is_accepted_where_a_float_is_expected() -> None:
    stage = from_dict(GraphConfig, with_stage(0, placement={"memory_fraction": 1})).stages[0]
    fraction = stage.placement.memory_fraction
    assert fraction == 1.0 and isinstance(fraction, float)


def test_exponent_without_dot_is_a_float() -> None:  # PyYAML alone reads "1e-3" as a string
    graph = load_graph_yaml(DESIGN_YAML.replace("memory_fraction: 0.1", "memory_fraction: 1e-1"))
    assert graph.stage("code2wav").placement.memory_fraction == pytest.approx(0.1)


# ---- unknown keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.update(conector="tcp"), "conector: unknown key (did you mean connector?)"),
    (lambda d: d["stages"][1]["ar"].update(max_num_seq=3),
     "stages[1].ar.max_num_seq: unknown key (did you mean max_num_seqs?)"),
    (lambda d: d["stages"][1]["inputs"][0].update(adaptor="x"),
     "stages[1].inputs[0].adaptor: unknown key (did you mean adapter?)"),
    (lambda d: d["stages"][0]["ar"]["sampling"].update(temprature=1.0),
     "stages[0].ar.sampling.temprature: unknown key (did you mean temperature?)"),
])
def test_unknown_key_names_its_path_and_a_close_match(mutate, expected: str) -> None:
    data = design_dict()
    mutate(data)
    assert error(data) == expected


def test_python_name_of_an_aliased_key_points_to_the_yaml_key() -> None:
    data = design_dict()
    inp = data["stages"][1]["inputs"][0]
    inp["source"] = inp.pop("from")
    assert error(data) == "stages[1].inputs[0].source: unknown key (did you mean from?)"


def test_unknown_key_without_close_match_lists_the_known_keys() -> None:
    msg = error({**design_dict(), "zzz": 1})
    assert msg == "zzz: unknown key (known keys: stages, connector, backend, model, ray_address)"


# ---- types, literals, required keys, field checks ---------------------------------------------

@pytest.mark.parametrize("data, expected", [
    ({**design_dict(), "connector": 5}, "connector: expected a string, got int"),
    ({"stages": {"name": "x"}}, "stages: expected a list, got dict"),
    ({"stages": ["thinker"]}, "stages[0]: expected a mapping, got str"),
    (with_stage(0, ar={"max_num_seqs": "64"}),
     "stages[0].ar.max_num_seqs: expected an integer, got str"),
    (with_stage(0, ar={"max_num_seqs": True}),
     "stages[0].ar.max_num_seqs: expected an integer, got bool"),
    (with_stage(0, ar={"max_num_seqs": 8.0}),
     "stages[0].ar.max_num_seqs: expected an integer, got float"),
    (with_stage(0, placement={"memory_fraction": True}),
     "stages[0].placement.memory_fraction: expected a number, got bool"),
    (with_stage(0, ar={"kv_cache": {"enable_prefix_caching": 1}}),
     "stages[0].ar.kv_cache.enable_prefix_caching: expected a boolean, got int"),
    (with_stage(0, placement={"devices": 0}),
     "stages[0].placement.devices: expected a list, got int"),
    (with_stage(0, placement={"devices": [0, "1"]}),
     "stages[0].placement.devices[1]: expected an integer, got str"),
    (with_stage(0, ar={"max_model_len": "long"}),
     "stages[0].ar.max_model_len: expected an integer or null, got str"),
    (with_stage(0, ar={"sampling": [1]}), "stages[0].ar.sampling: expected a mapping, got list"),
    (with_stage(0, inputs=[["thinker", "x"]]), "stages[0].inputs[0]: expected a mapping, got list"),
    (with_stage(0, ar={"sampling": {"top_k": "50"}}),
     "stages[0].ar.sampling.top_k: expected an integer, got str"),
    (with_stage(0, parallel={"tp": 0}), "stages[0].parallel.tp: must be >= 1, got 0"),
])
def test_wrong_type_names_its_path(data: dict, expected: str) -> None:
    assert error(data) == expected


def test_bad_literal_lists_the_allowed_values() -> None:
    assert error(with_stage(0, kind="arr")) == (
        "stages[0].kind: 'arr' is not one of ar, diffusion, generation (did you mean ar?)")
    assert error(with_stage(2, final="speech")).startswith(
        "stages[2].final: 'speech' is not one of text, audio, image, video, tensor")
    assert error({**design_dict(), "backend": "thread"}) == (
        "backend: 'thread' is not one of process, inproc, ray")


def test_missing_required_key_names_the_key() -> None:
    data = design_dict()
    del data["stages"][2]["name"]
    assert error(data) == "stages[2]: missing required key 'name'"
    data = design_dict()
    del data["stages"][1]["inputs"][0]["from"]
    assert error(data) == "stages[1].inputs[0]: missing required key 'from'"
    assert error({"connector": "shm"}) == "missing required key 'stages'"


@pytest.mark.parametrize("changes, expected", [
    ({"placement": {"memory_fraction": 1.5}},
     "stages[1].placement.memory_fraction: must be in (0, 1], got 1.5"),
    ({"ar": {"kv_cache": {"block_size": 24}}},
     "stages[1].ar.kv_cache.block_size: must be a power of two, got 24"),
    ({"placement": {"devices": []}}, "stages[1].placement.devices: must be a non-empty list"),
    ({"placement": {"devices": [0, 0]}}, "stages[1].placement.devices: must not repeat a device"),
    ({"placement": {"stream_priority": 1}}, "stages[1].placement.stream_priority: must be <= 0"),
    ({"timeouts": {"step_s": 0}}, "stages[1].timeouts.step_s: must be > 0"),
    ({"name": "talk.er"}, "stages[1].name: must be letters, digits"),
    ({"ar": {"sampling": {"temperature": -1}}},
     "stages[1].ar.sampling.temperature=-1.0: must be a finite number in [0, 2]"),
    ({"ar": {"sampling": {"max_tokens": 4, "min_tokens": 5}}},
     "stages[1].ar.sampling.min_tokens=5: must"),
    ({"ar": {"sampling": {"output_hidden_layers": [3]}}},
     "stages[1].ar.sampling.output_hidden_layers: set ar.output_hidden_layers on the stage"),
    ({"diffusion": {}}, "stages[1].diffusion: settings of diffusion stages; stage 'talker' is "
                        "of kind ar"),
])
def test_field_checks_are_reported_with_the_path(changes: dict, expected: str) -> None:
    assert error(with_stage(1, **changes)).startswith(expected)


def test_direct_construction_checks_fields_too() -> None:
    with pytest.raises(ValueError, match=r"^memory_fraction: must be in \(0, 1\]"):
        StageConfig(name="x", kind="ar", placement=Placement(memory_fraction=0.0))


# ---- YAML --------------------------------------------------------------------------------------

def test_malformed_yaml_names_line_and_column() -> None:
    text = DESIGN_YAML.replace("    kind: generation", "    kind: generation: oops")
    line = text.splitlines().index("    kind: generation: oops") + 1
    with pytest.raises(ConfigError, match=rf"^line {line}, column \d+: mapping values"):
        load_graph_yaml(text)


def test_unclosed_flow_list_names_a_line() -> None:
    with pytest.raises(ConfigError, match=r"^line \d+, column \d+: "):
        load_graph_yaml("stages: [{name: a, kind: ar}\nconnector: shm\n")


def test_duplicate_key_is_an_error_with_its_line() -> None:
    text = DESIGN_YAML.replace("      memory_fraction: 0.2\n",
                               "      memory_fraction: 0.2\n      memory_fraction: 0.3\n")
    line = text.splitlines().index("      memory_fraction: 0.3") + 1
    with pytest.raises(ConfigError, match=rf"^line {line}, column 7: duplicate key "
                                          r"'memory_fraction'"):
        load_graph_yaml(text)


@pytest.mark.parametrize("text, got", [("- a\n- b\n", "list"), ("", "null"), ("shm\n", "str")])
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    with pytest.raises(ConfigError, match=rf"^top level: expected a mapping .* got {got}$"):
        load_graph_yaml(text)


def test_loads_from_a_path_and_names_the_file_in_yaml_errors(tmp_path: Path) -> None:
    good = tmp_path / "graph.yaml"
    good.write_text(DESIGN_YAML)
    assert load_graph_yaml(good) == load_graph_yaml(str(good)) == load_graph_yaml(DESIGN_YAML)
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: line \d+, column \d+"):
        load_graph_yaml(bad)
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read"):
        load_graph_yaml(str(tmp_path / "missing.yaml"))


# ---- overrides ---------------------------------------------------------------------------------

def test_overrides_parse_values_as_yaml() -> None:
    graph = load_graph_yaml(DESIGN_YAML)
    out = apply_overrides(graph, [
        "talker.placement.memory_fraction=0.25",
        "talker.ar.max_num_seqs=8",
        "talker.ar.kv_cache.enable_prefix_caching=false",
        "talker.placement.devices=[0, 1]",
        "talker.ar.max_model_len=4096",
        "talker.ar.sampling.temperature=0.7",
        "thinker.ar.sampling.seed=3",
        "talker.inputs.0.chunked=no",
        "talker.model=Org/Other-Model",
        "connector=tcp",
        "model=Qwen/Qwen3-Omni",
    ])
    talker = out.stage("talker")
    assert talker.placement.memory_fraction == 0.25 and talker.ar.max_num_seqs == 8
    assert talker.ar.kv_cache.enable_prefix_caching is False
    assert talker.placement.devices == (0, 1)
    assert talker.ar.max_model_len == 4096 and talker.inputs[0].chunked is False
    assert talker.ar.sampling == {"temperature": 0.7, "top_k": 50, "repetition_penalty": 1.05}
    assert talker.model == "Org/Other-Model"
    assert out.stage("thinker").default_sampling().seed == 3
    assert (out.connector, out.model) == ("tcp", "Qwen/Qwen3-Omni")
    assert graph == load_graph_yaml(DESIGN_YAML)  # the input graph is untouched
    assert apply_overrides(graph, []) is graph


def test_async_scheduling_override_reaches_the_engine_config() -> None:
    graph = load_graph_yaml(DESIGN_YAML)
    assert graph.stage("thinker").ar_config("m", "cpu").async_scheduling     # the default
    out = apply_overrides(graph, ["thinker.ar.async_scheduling=false"])
    assert out.stage("thinker").ar_config("m", "cpu").async_scheduling is False


def test_overrides_apply_in_order() -> None:
    graph = apply_overrides(load_graph_yaml(DESIGN_YAML),
                            ["talker.ar.max_model_len=10", "talker.ar.max_model_len=null",
                             "talker.name=speaker", "speaker.ar.max_num_seqs=4"])
    assert graph.stage("speaker").ar.max_model_len is None
    assert graph.stage("speaker").ar.max_num_seqs == 4


@pytest.mark.parametrize("override, expected", [
    ("talkr.memory_fraction=0.2", "talkr.memory_fraction: 'talkr' is neither a stage nor a "
                                  "graph key (did you mean talker?)"),
    ("talker.ar.max_num_seq=8", "talker.ar.max_num_seq: unknown key (did you mean "
                                "max_num_seqs?) [override 'talker.ar.max_num_seq=8']"),
    ("talker.max_num_seqs=8", "talker.max_num_seqs: moved to talker.ar.max_num_seqs "
                              "[override 'talker.max_num_seqs=8']"),
    ("talker.ar.sampling.temprature=0.5", "talker.ar.sampling.temprature: unknown key (did you "
                                          "mean temperature?)"),
    ("talker.placement.memory_fraction=lots",
     "talker.placement.memory_fraction: expected a number, got str"),
    ("talker.placement.memory_fraction=2",
     "talker.placement.memory_fraction: must be in (0, 1], got 2.0"),
    ("talker.ar.kv_cache.enable_prefix_caching=1",
     "talker.ar.kv_cache.enable_prefix_caching: expected a boolean"),
    ("conector=tcp", "conector: 'conector' is neither a stage nor a graph key (did you mean "
                     "connector?)"),
    ("connector=udp", "connector: 'udp' is not one of auto, inproc, shm, tcp"),
    ("talker.placement.memory_fraction.x=1", "talker.placement.memory_fraction.x: "
                                             "talker.placement.memory_fraction is a float"),
    ("talker.inputs.3.chunked=true", "talker.inputs.3.chunked: talker.inputs is a list of 1"),
    ("talker.placement.devices=[0", "talker.placement.devices: value '[0': line 1, column"),
    ("talker.memory_fraction", "'talker.memory_fraction': expected NAME.KEY=VALUE"),
    ("talker=1", "talker: expected talker.KEY=VALUE"),
])
def test_bad_override_names_the_key_with_a_hint(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_graph_yaml(DESIGN_YAML), [override])
    assert str(info.value).startswith(expected)


# ---- round trip --------------------------------------------------------------------------------

def test_to_dict_from_dict_round_trip() -> None:
    graph = apply_overrides(load_graph_yaml(DESIGN_YAML),
                            ["talker.ar.output_hidden_layers=[0, 12]", "backend=inproc"])
    plain = to_dict(graph)
    assert plain["stages"][1]["inputs"][0]["from"] == "thinker"  # the YAML spelling
    assert plain["stages"][1]["placement"]["devices"] == [0]  # plain lists, as YAML writes
    assert from_dict(GraphConfig, plain) == graph
    assert load_graph_yaml(yaml.safe_dump(plain)) == graph


def test_to_dict_can_omit_defaults() -> None:
    graph = load_graph_yaml(DESIGN_YAML)
    short = to_dict(graph, omit_defaults=True)
    assert short["stages"][2] == {
        "name": "code2wav", "kind": "generation", "component": "code2wav",
        "inputs": [{"from": "talker", "adapter": "qwen3_omni.talker_to_code2wav",
                    "chunked": True}],
        "final": "audio", "placement": {"memory_fraction": 0.1}, "generation": {}}
    assert short["connector"] == "shm" and "backend" not in short  # not auto; process
    assert from_dict(GraphConfig, short) == graph


def test_from_dict_handles_other_config_classes() -> None:
    cfg = from_dict(ARConfig, {"model": "m", "device": "cuda:1", "dtype": "bfloat16",
                               "kv_cache": {"block_size": 32, "num_blocks": None}})
    assert cfg.device == "cuda:1" and cfg.kv_cache.block_size == 32
    assert from_dict(ARConfig, {"device": "cpu"}).device == "cpu"
    with pytest.raises(ConfigError, match=r"^kv_cache\.blocksize: unknown key \(did you mean "
                                          r"block_size\?\)"):
        from_dict(ARConfig, {"kv_cache": {"blocksize": 32}})
    assert from_dict(tuple[int, ...], [1, 2], "ids") == (1, 2)
    with pytest.raises(ConfigError, match=r"^ids\[1\]: expected an integer, got null"):
        from_dict(tuple[int, ...], [1, None], "ids")


def test_a_yaml_error_in_a_stage_config_names_where_line_and_column(tmp_path: Path) -> None:
    """As the CLI's `--stage-config` does, the Python API's `stage_config` (a file or YAML
    text) reports a syntax error with its place, not PyYAML's own text."""
    from omnistage.configs.defaults import resolve_graph

    text = "stages:\n  - {name: a, kind: ar\n"
    with pytest.raises(ConfigError, match=r"^stage_config: line 3, column 1: expected ','"):
        resolve_graph(None, None, text)
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: line 3, column 1")):
        resolve_graph(None, None, str(path))
