"""Device-time benchmarks of our GPU kernels in isolation (CUDA; one process, random weights at
Qwen3-0.6B's shapes), run as modules during a GPU session (benchmarks/device_session.sh):

    python -m omnistage.benchmarks.kernels.layer_kernel      one-row decode step's layers:
                                                            the layer kernel against per-op
    python -m omnistage.benchmarks.kernels.decode_attention  one step's attention, one kernel
                                                            against three
    python -m omnistage.benchmarks.kernels.sweep_gemv        matrix-vector tiles against cuBLAS
    python -m omnistage.benchmarks.kernels.int4_sweep        W4A16 matrix-vector kernels (first,
                                                            split-K tiles) against bf16
    python -m omnistage.benchmarks.kernels.fp8_attention     a DiT's attention: the FP8 kernel
                                                            (a tile sweep) against bf16 SDPA
    python -m omnistage.benchmarks.kernels.profile_decode    device time per kernel of decode
                                                            steps (torch.profiler)
"""
