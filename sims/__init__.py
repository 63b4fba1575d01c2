"""Experiments: learners, protocols and sweeps (docs/theory.md sections 3-5). Scripts write tidy CSV; figures/ plots."""
