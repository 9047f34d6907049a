"""Noise schedules and ODE solvers, one file each, as pure functions of `(sigmas, step_idx)`."""
