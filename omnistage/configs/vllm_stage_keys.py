"""The tables of vllm_stage_config: which of our shipped graphs a vLLM-Omni stage config stands
for, and what becomes of each of its keys (mapped, ignored with the reason, or accepted only with
the one value that is what runs here)."""

from __future__ import annotations

# (model_arch or model_class_name, model_stage) -> our stage names that vLLM-Omni stage stands
# for, one table per shipped graph; a file takes the first graph whose table holds all its pairs
# and whose stages it covers. Two vLLM-Omni stages naming one of ours are folded into it (its
# first one's keys set it).
_QWEN3_OMNI = "Qwen3OmniMoeForConditionalGeneration"
_QWEN2_5_OMNI = "Qwen2_5OmniForConditionalGeneration"
_QWEN_IMAGE = "QwenImagePipeline"
VARIANTS: tuple[tuple[str, dict[tuple[str, str], tuple[str, ...]]], ...] = (
    ("qwen3_omni.yaml", {(_QWEN3_OMNI, "thinker"): ("thinker",),
                         (_QWEN3_OMNI, "talker"): ("talker",),
                         (_QWEN3_OMNI, "code2wav"): ("code2wav",)}),
    ("qwen2_5_omni.yaml", {(_QWEN2_5_OMNI, "thinker"): ("thinker",),
                           (_QWEN2_5_OMNI, "talker"): ("talker",),
                           (_QWEN2_5_OMNI, "code2wav"): ("token2wav",),
                           (_QWEN2_5_OMNI, "token2wav"): ("token2wav",)}),
    # vLLM-Omni's first Qwen3-TTS file runs it as one stage; here it is talker -> code2wav
    ("qwen3_tts.yaml", {("Qwen3TTSForConditionalGeneration", "qwen3_tts"): ("talker", "code2wav")}),
    ("qwen3_tts.yaml", {("Qwen3TTSTalkerForConditionalGeneration", "qwen3_tts"): ("talker",),
                        ("Qwen3TTSCode2Wav", "code2wav"): ("code2wav",)}),
    ("qwen_image.yaml", {(_QWEN_IMAGE, "diffusion"): ("dit",), (_QWEN_IMAGE, "dit"): ("dit",)}),
    # the text encoder in a stage of its own; vLLM-Omni's three-stage file also splits the VAE
    # decode off the denoising loop, which here runs inside the dit stage
    ("qwen_image_split.yaml", {
        ("Qwen2_5_VLForConditionalGeneration__", "text_encoder"): ("text_encoder",),
        ("Qwen2_5_VLForConditionalGeneration", "text_encoder"): ("text_encoder",),
        (_QWEN_IMAGE, "diffusion"): ("dit",), (_QWEN_IMAGE, "encode"): ("text_encoder",),
        (_QWEN_IMAGE, "denoise"): ("dit",), (_QWEN_IMAGE, "decode"): ("dit",)}),
    ("wan.yaml", {("WanPipeline", "diffusion"): ("dit",), ("WanPipeline", "dit"): ("dit",)}),
)

# custom_process_input_func / custom_process_next_stage_input_func (last dotted name, without
# "_async_chunk") -> the edge's adapter here; None: an edge inside one of our stages (folded)
PROCESS_FUNCS: dict[str, str | None] = {
    "thinker2talker": "tensors", "talker2code2wav": "tensors", "talker2token2wav": "tensors",
    "talker2codewav": "tensors", "code2wav": "tensors", "encode_to_denoise": "tensors",
    "denoise_to_decode": None}

_MACHINERY = "vLLM-Omni's machinery; each stage here runs the engine of its kind"
_CONNECTOR = "tensors between stages travel through the graph's connector (auto: shm on one host)"
IGNORED = {   # keys accepted with no effect (stage keys and engine_args keys), and why
    "worker_cls": _MACHINERY, "worker_type": _MACHINERY, "scheduler_cls": _MACHINERY,
    "stage_type": _MACHINERY, "distributed_executor_backend": _MACHINERY,
    "chunk_processor": "each stage's own streaming code cuts its chunks here",
    "step_execution": "the diffusion engine batches requests step by step always (same images)",
    "engine_output_type": "the edge's adapter carries the stage's output",
    "hf_config_name": "each component reads its part of the checkpoint's config",
    "trust_remote_code": "no remote code runs; every model's code is built in",
    "is_comprehension": "the stage that makes text is the graph's final text stage",
    "max_batch_size": "requests batch per stage up to its max_num_seqs",
    "process": "every stage runs in its own process",
    "input_connectors": _CONNECTOR, "output_connectors": _CONNECTOR,
    "tts_args": "instructions are not cut to a length here",
    "model_arch": "picks the family's graph", "model_class_name": "picks the family's graph",
    "model_stage": "picks the stage",
}
STAGE_KEYS = {"stage_id", "runtime", "engine_args", "engine_input_source",
              "custom_process_input_func", "final_output", "final_output_type",
              "default_sampling_params", "is_comprehension", "stage_type", "worker_type",
              "input_connectors", "output_connectors", "tts_args"}
RUNTIME_KEYS = {"devices", "max_batch_size", "process"}
TOP_RUNTIME_KEYS = {"enabled", "defaults", "edges", "connectors"}
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed",
                 "repetition_penalty", "detokenize", "stop_token_ids"}
# a diffusion stage's default_sampling_params: vLLM-Omni's request defaults; here a request
# names its own or gets the pipeline's (docs/migration-vllm-omni.md)
DIFFUSION_SAMPLING_KEYS = {"seed", "num_inference_steps", "true_cfg_scale", "guidance_scale",
                           "guidance_scale_2", "height", "width", "num_frames", "fps",
                           "negative_prompt", "num_outputs_per_prompt"}

# engine_args key -> its nested key path on our stage; "*" stands for the record of the stage's
# kind (ar / diffusion / generation); a path under "ar" is skipped on a stage of another kind
ENGINE_KEYS: dict[str, tuple[str, ...]] = {
    "gpu_memory_utilization": ("placement", "memory_fraction"),
    "tensor_parallel_size": ("parallel", "tp"),
    "dtype": ("dtype",),
    "max_num_seqs": ("*", "max_num_seqs"),
    "max_model_len": ("ar", "max_model_len"),
    "max_num_batched_tokens": ("ar", "max_num_batched_tokens"),
    "enforce_eager": ("ar", "enforce_eager"),
    "async_scheduling": ("ar", "async_scheduling"),
    "enable_prefix_caching": ("ar", "kv_cache", "enable_prefix_caching"),
    "seed": ("ar", "seed"),
    "async_chunk": (), "async_chunk_stream": (),   # read by _edges: the stage's inputs chunked
    "custom_process_next_stage_input_func": (),    # checked by _edges
}
# engine_args keys accepted with the one value that is what runs here
ONLY_VALUE = {"ode_solver_class": "RungeKutta4ODESolver"}   # token2wav integrates with RK4

# runtime.connectors.<name>.extra keys -> the last stage's generation option they set, or None:
# accepted, no effect here
CONNECTOR_EXTRA: dict[str, str | None] = {
    "codec_chunk_frames": "chunk_frames",
    # the vocoder sees its whole receptive field before a chunk: the stream equals the whole
    # decode, at any context vLLM-Omni names
    "codec_left_context_frames": None,
    "shm_threshold_bytes": None, "codec_streaming": None, "connector_get_sleep_s": None,
    "connector_get_max_wait_first_chunk": None, "connector_get_max_wait": None}
CONNECTOR_KEYS = {"name", "extra"}
