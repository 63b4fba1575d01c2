"""Experiments: learners, protocols and sweeps (SPEC sections 3-5). Scripts write tidy CSV; figures/ plots."""
