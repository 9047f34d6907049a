"""The random-weight Qwen3-Omni checkpoints the omni benchmarks run on: the "bench" sizes (the
real layer structure scaled to one GPU), the "real" ones (Qwen3-Omni-30B-A3B's), the tiny test
checkpoint; built and saved in the run (omni.py's docstring has the sizes and why), and the
reference's loading of a checkpoint over the GPUs our thinker's ranks use (`spread`)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.benchmarks.common import default_dtype

# Size changes against omnistage.testing.tiny_omni's config (which carries the token ids).
BENCH_SIZES = {
    "thinker_text": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8,
                         max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [24, 20, 20], "interleaved": True}),
    "audio": dict(output_dim=2048),
    "vision": dict(out_hidden_size=2048),
    "talker_text": dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                        head_dim=128, moe_intermediate_size=384,
                        shared_expert_intermediate_size=768, num_experts=32,
                        num_experts_per_tok=8, max_position_embeddings=32768,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [24, 20, 20], "interleaved": True}),
    "code_predictor": dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, num_code_groups=16, max_position_embeddings=32768),
    # codec ids: 0..2047 codes, specials and speakers in the top 1024 of the talker's 3072
    "talker": dict(num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=6,
                   codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150,
                   codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
                   speaker_id={"ethan": 2302, "chelsie": 2301}),
    "code2wav": dict(codebook_size=2048, hidden_size=1024, num_attention_heads=16,
                     num_key_value_heads=16, intermediate_size=3072, num_hidden_layers=8,
                     num_quantizers=16, sliding_window=72, upsample_rates=[8, 5, 4, 3],
                     upsampling_ratios=[2, 2], decoder_dim=1536, max_position_embeddings=8000),
}
REAL_SIZES = {"thinker_text": dict(num_hidden_layers=48, num_experts=128, vocab_size=152064),
              "talker_text": dict(num_hidden_layers=20, num_experts=128)}


def _bench_config(tokenizer, real: bool = False):
    """tiny_omni's config (token ids, structure) with BENCH_SIZES applied (and REAL_SIZES)."""
    from transformers import Qwen3OmniMoeConfig

    from omnistage.testing.tiny_omni import tiny_omni_config

    raw = tiny_omni_config(tokenizer).to_dict()
    thinker, talker = raw["thinker_config"], raw["talker_config"]
    thinker["text_config"].update(BENCH_SIZES["thinker_text"])
    if real:
        thinker["text_config"].update(REAL_SIZES["thinker_text"])
    thinker["audio_config"].update(BENCH_SIZES["audio"])
    thinker["vision_config"].update(BENCH_SIZES["vision"])
    talker["text_config"].pop("num_local_experts", None)     # to_dict's name of num_experts
    talker["text_config"].update(BENCH_SIZES["talker_text"])
    if real:
        talker["text_config"].update(REAL_SIZES["talker_text"])
    talker["code_predictor_config"].update(BENCH_SIZES["code_predictor"])
    talker["code_predictor_config"].pop("layer_types", None)   # derived from the layer count
    talker.update(BENCH_SIZES["talker"])
    raw["code2wav_config"].update(BENCH_SIZES["code2wav"])
    return Qwen3OmniMoeConfig(**{k: v for k, v in raw.items()
                                 if k not in ("architectures", "transformers_version")})


def build_checkpoint(sizes: str, path: Path, device: torch.device, dtype: torch.dtype):
    """Save a random Qwen3-Omni checkpoint (+ tokenizer, processor) to `path`; return the
    transformers model, on `device` in `dtype` (real, on CUDA: built on two GPUs, returned on
    the CPU)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnistage.testing.tiny_omni import (_randomize, build_tiny_omni_tokenizer,
                                             save_tiny_omni_processor, tiny_omni_config)

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_omni_tokenizer(path)
    torch.manual_seed(0)
    if sizes == "tiny":     # the test checkpoint, weights drawn so every path matters
        model = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config(tokenizer)).eval()
        _randomize(model, 0)
        model = model.to(device, dtype)
    elif sizes == "real" and device.type == "cuda":   # saved from the CPU: transformers'
        # save converts the fused experts with copies on their device, which 68 GB leave no
        # room for (measured: out of memory at 78 GiB on GPU 0)
        model = build_on_two_gpus(_bench_config(tokenizer, real=True), dtype).cpu()
    else:                   # built on the device in dtype: transformers' init, in seconds
        with torch.device(device), default_dtype(dtype):
            model = Qwen3OmniMoeForConditionalGeneration(
                _bench_config(tokenizer, real=sizes == "real")).eval()
    model.config.dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_omni_processor(path, tokenizer)
    return model


def build_on_two_gpus(config, dtype: torch.dtype, devices: tuple[str, str] = ("cuda:0",
                                                                               "cuda:1")):
    """The real size (68 GB in bf16) outgrows one GPU, transformers' init on the CPU runs at
    ~70 MB/s (10 minutes were not enough) and on the GPU it took more memory than the weights:
    the model is laid out on the meta device, its thinker then made on devices[0], talker and
    code2wav on devices[1], and every weight drawn there (N(0, 0.02); norms 1, biases 0). A
    timing model: what matters is the shapes (the reference reloads the saved folder, which
    rebuilds the buffers that are not saved). Made in `dtype` even where transformers' own
    layout takes float32 (5.17 does, measured)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"), default_dtype(dtype):
        model = Qwen3OmniMoeForConditionalGeneration(config).eval().to(dtype)
    model.thinker.to_empty(device=devices[0])
    model.talker.to_empty(device=devices[1])
    model.code2wav.to_empty(device=devices[1])
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point():
                t.zero_()
            elif "norm" in name and name.endswith("weight"):
                t.fill_(1.0)
            elif name.endswith("bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02)
    return model


def spread(path: Path, num_gpus: int, dtype: torch.dtype):
    """The saved checkpoint for the reference, on the GPUs our thinker's ranks use: on GPU 0
    alone where it fits there (transformers 5.17's generate fails when device_map="auto" puts
    the talker on another GPU than its inputs: torch.isin across cuda:0 and cuda:1, measured
    at 30B on two H100s; one GPU also spares the reference the hops between cards), else
    spread by device_map="auto" (which needs accelerate)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"reference: {weights / 2**30:.1f} GiB of weights", flush=True)
    if weights < torch.cuda.mem_get_info(0)[0] - 6 * 2**30:       # room for its activations
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            str(path), dtype=dtype, device_map={"": 0}).eval()
    budget = {i: torch.cuda.mem_get_info(i)[0] * 9 // 10 for i in range(num_gpus)}
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(path), dtype=dtype, device_map="auto", max_memory=budget).eval()
