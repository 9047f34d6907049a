"""Benchmarks of our engines against the reference implementations (transformers, diffusers),
run in one process on the same random-weight checkpoints of real architectures (no download).

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

`omnistage bench {ar,omni,tts,diffusion,video}` runs them (entrypoints/cli/bench.py); each
writes one JSON file (GPU name, library versions, config, raw numbers, ratios). `--tiny` shrinks
every size so a run takes seconds on a CPU: what CI runs to keep the commands working, not a
measurement.
"""
