"""vLLM-Omni's own shipped stage configs (tests/fixtures/vllm_omni/upstream/, unchanged copies)
translate to our shipped graph of their family: the same stages, kinds, components, adapters and
final outputs, and each stage carries the values the file sets (devices, memory, engine args,
sampling defaults, streaming edges)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from omnistage.configs.graph import load_graph
from omnistage.configs.parse import ConfigError
from omnistage.configs.schema import GraphConfig
from omnistage.configs.vllm_stage_config import stage_configs_yaml, translate

UPSTREAM = Path(__file__).parents[2] / "fixtures" / "vllm_omni" / "upstream"

_OMNI3_THINKER = {"placement.devices": (0, 1), "placement.memory_fraction": 0.6,
                  "parallel.tp": 2, "ar.enforce_eager": True, "ar.seed": 42,
                  "ar.max_num_batched_tokens": 32768, "ar.kv_cache.enable_prefix_caching": False,
                  "sampling": {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 2048,
                               "repetition_penalty": 1.05, "detokenize": True}}
_OMNI3_TALKER = {"placement.memory_fraction": 0.3, "ar.seed": 42,
                 "sampling": {"temperature": 0.9, "top_k": 50, "max_tokens": 4096,
                              "repetition_penalty": 1.05, "stop_token_ids": [2150],
                              "detokenize": False}}
_OMNI25 = {"thinker": {"placement.devices": (0,), "placement.memory_fraction": 0.8,
                       "ar.kv_cache.enable_prefix_caching": False, "ar.seed": 42,
                       "sampling": {"temperature": 0.0, "max_tokens": 2048,
                                    "repetition_penalty": 1.1}},
           "talker": {"placement.devices": (1,), "placement.memory_fraction": 0.8,
                      "sampling": {"temperature": 0.9, "top_p": 0.8, "top_k": 40,
                                   "max_tokens": 2048, "stop_token_ids": [8294]}},
           "token2wav": {"placement.devices": (0,), "placement.memory_fraction": 0.15}}
_TTS_TALKER = {"placement.memory_fraction": 0.3, "ar.max_num_batched_tokens": 512,
               "ar.max_model_len": 4096, "ar.enforce_eager": False, "ar.seed": 42,
               "sampling": {"temperature": 0.9, "top_k": 50, "max_tokens": 4096,
                            "repetition_penalty": 1.05, "stop_token_ids": [2150],
                            "min_tokens": 2}}   # min_tokens: our graph's, the file has none
# file -> (our shipped graph, chunked edges, {stage: {dotted field: value}})
CASES: dict[str, tuple[str, bool, dict[str, dict[str, object]]]] = {
    "qwen3_omni_moe.yaml": ("qwen3_omni.yaml", False, {
        "thinker": _OMNI3_THINKER, "talker": {**_OMNI3_TALKER, "placement.devices": (1,)},
        "code2wav": {"placement.devices": (0,), "placement.memory_fraction": 0.1}}),
    "qwen3_omni_moe_async_chunk.yaml": ("qwen3_omni.yaml", True, {
        "thinker": _OMNI3_THINKER, "talker": {**_OMNI3_TALKER, "placement.devices": (0,)},
        "code2wav": {"placement.devices": (1,), "placement.memory_fraction": 0.1}}),
    "qwen2_5_omni.yaml": ("qwen2_5_omni.yaml", True, _OMNI25),
    "qwen2_5_omni_async_chunk.yaml": ("qwen2_5_omni.yaml", True, {
        **_OMNI25, "talker": {**_OMNI25["talker"], "ar.async_scheduling": False,
                              "ar.max_num_batched_tokens": 32768}}),
    "qwen3_tts.yaml": ("qwen3_tts.yaml", True, {
        "talker": {**_TTS_TALKER, "ar.max_num_seqs": 10},
        "code2wav": {"placement.memory_fraction": 0.3, "generation.max_num_seqs": 1,
                     "generation.options": {"chunk_frames": 25, "first_chunk_frames": 2}}}),
    "qwen3_tts_batch.yaml": ("qwen3_tts.yaml", True, {
        "talker": {**_TTS_TALKER, "ar.max_num_seqs": 4},
        "code2wav": {"placement.memory_fraction": 0.2, "generation.max_num_seqs": 4}}),
    "qwen3_tts_no_async_chunk.yaml": ("qwen3_tts.yaml", False, {
        "talker": {**_TTS_TALKER, "ar.max_num_seqs": 1},
        "code2wav": {"placement.memory_fraction": 0.2, "generation.max_num_seqs": 1}}),
    "QwenImagePipeline.yaml": ("qwen_image_split.yaml", False, {
        "text_encoder": {"placement.devices": (0,), "placement.memory_fraction": 0.8},
        "dit": {"placement.devices": (1,), "placement.memory_fraction": 0.8,
                "diffusion.max_num_seqs": 8}}),
    # the VAE-decode stage (devices "0") is folded into the dit, whose denoise stage sets it
    "qwen_image_3stage.yaml": ("qwen_image_split.yaml", False, {
        "text_encoder": {"placement.devices": (0,), "diffusion.max_num_seqs": 1},
        "dit": {"placement.devices": (1,), "diffusion.max_num_seqs": 1}}),
}


def shipped(name: str) -> GraphConfig:
    return load_graph(resources.files("omnistage.configs").joinpath(name).read_text())


def field(stage: object, dotted: str) -> object:
    if dotted == "sampling":
        return stage.ar.sampling
    value = stage
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def test_every_upstream_file_is_a_case() -> None:
    assert sorted(p.name for p in UPSTREAM.glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_upstream_file_translates_to_the_shipped_graph(name: str) -> None:
    ours, chunked, fields = CASES[name]
    graph, want = load_graph(stage_configs_yaml(UPSTREAM / name)), shipped(ours)
    assert [(s.name, s.kind, s.component, s.final) for s in graph.stages] == \
        [(s.name, s.kind, s.component, s.final) for s in want.stages]
    assert [[(i.source, i.adapter) for i in s.inputs] for s in graph.stages] == \
        [[(i.source, i.adapter) for i in s.inputs] for s in want.stages]
    assert {i.chunked for s in graph.stages for i in s.inputs} <= {chunked}
    assert (graph.connector, graph.backend) == (want.connector, want.backend)
    for stage_name, expected in fields.items():
        stage = graph.stage(stage_name)
        for dotted, value in expected.items():
            got = field(stage, dotted)
            if dotted == "sampling":   # the file's keys over the graph's defaults
                got = {k: got[k] for k in value}
            assert got == value, (stage_name, dotted)


def test_folded_decode_stage_is_checked() -> None:
    import yaml

    doc = yaml.safe_load((UPSTREAM / "qwen_image_3stage.yaml").read_text())
    doc["stage_args"][2]["engine_args"]["kv_transfer_config"] = {}
    with pytest.raises(ConfigError, match=r"stage_args\[2\]\.engine_args\.kv_transfer_config"):
        translate(doc, "f")
    doc = yaml.safe_load((UPSTREAM / "qwen_image_3stage.yaml").read_text())
    doc["stage_args"][2]["final_output"] = False
    doc["stage_args"][1]["final_output"] = False
    with pytest.raises(ConfigError, match=r"final_output: false: stage dit's output is the "
                                          r"graph's image output"):
        translate(doc, "f")


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["stage_args"][2]["engine_args"].update(ode_solver_class="Euler"),
     "stage_args[2].engine_args.ode_solver_class: 'Euler': only RungeKutta4ODESolver runs"),
    (lambda d: d["runtime"].update(connectors={"c": {"name": "X", "extra": {"rdma": 1}}}),
     "runtime.connectors.c.extra.rdma: no counterpart here"),
    (lambda d: d["stage_args"][1]["engine_args"].update(
        custom_process_next_stage_input_func="a.b.mine"),
     "stage_args[1].engine_args.custom_process_next_stage_input_func: 'a.b.mine'"),
])
def test_upstream_keys_refused_with_other_values(edit, message: str) -> None:
    import yaml

    doc = yaml.safe_load((UPSTREAM / "qwen2_5_omni.yaml").read_text())
    edit(doc)
    with pytest.raises(ConfigError) as e:
        translate(doc, "f")
    assert message in str(e.value)


def test_diffusion_sampling_defaults_are_checked() -> None:
    import yaml

    doc = yaml.safe_load((UPSTREAM / "qwen_image_3stage.yaml").read_text())
    doc["stage_args"][1]["default_sampling_params"]["temperature"] = 0.5
    with pytest.raises(ConfigError, match=r"stage_args\[1\]\.default_sampling_params\."
                                          r"temperature: not a diffusion parameter"):
        translate(doc, "f")


def test_a_deploy_config_is_refused_by_name() -> None:
    """vLLM-Omni's newer deploy grammar (vllm_omni/deploy/*.yaml): stages by stage_id only."""
    doc = {"async_chunk": True, "stages": [{"stage_id": 0, "max_num_seqs": 64}]}
    with pytest.raises(ConfigError, match="a vLLM-Omni deploy config .* is not translated"):
        translate(doc, "f")
