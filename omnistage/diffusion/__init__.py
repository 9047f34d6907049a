"""Diffusion-transformer engine: step-level batching of denoising requests, solvers, pipelines."""
