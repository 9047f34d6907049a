"""Every benchmark of the project lives here (docs/benchmarks.md says why); the repository's
`benchmarks/` holds only the GPU session scripts that run them and the results they wrote.

Against the reference implementations (transformers, diffusers, qwen-tts), in one process on
the same random-weight checkpoints of real architectures (no download), run by
`omnistage bench {ar,omni,tts,diffusion,video,realtime}` (entrypoints/cli/bench.py):

    ar.py         Qwen3-0.6B-shaped LLM: tokens/s, TTFT, TPOT at concurrency 1 / 8 / 64 against
                  transformers' generate, and single-stream speed against the weight-streaming
                  limit (memory bandwidth measured in the same run / bytes of weights)
    omni.py       Qwen3-Omni-shaped thinker -> talker -> code2wav: first audio chunk, real-time
                  factor, end-to-end latency at concurrency 1 / 8 against transformers'
                  generate(return_audio=True) run request by request
    tts.py        Qwen3-TTS 1.7B CustomVoice-shaped talker -> code2wav: real-time factor, first
                  audio, audio seconds per second at concurrency 1 / 8 / 32 against qwen-tts's
                  generate_custom_voice, run by tts_reference.py in its own environment
    diffusion.py  Qwen-Image-shaped transformer: seconds per image against diffusers on the same
                  weights, step caching (speed-up and PSNR), step-level batching at concurrency 4

Each writes one JSON file (GPU name, library versions, config, raw numbers, ratios). `--tiny`
shrinks every size so a run takes seconds on a CPU: what CI runs to keep the commands working,
not a measurement. `omnistage bench serve` loads any running OpenAI-compatible server
(serve.py).

Run as modules (`python -m omnistage.benchmarks.NAME`): ar_offline (offline throughput and
single-stream decode against transformers), ar_quant (a stage quantized at load, fp8 / int8 /
int4, against bf16: single-stream decode speed-up and token agreement), profile_ar and
profile_tts (where a step's time goes), soak (the server for minutes under mixed and hostile
load), cli_startup (how fast the command line answers), control_latency (a control message's
round trip), and kernels/ (our GPU kernels alone).
"""
