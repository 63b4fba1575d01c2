"""The bridge's command-line studies (scripts, the top layer beside sims/) and the flags they share.

Each answers ``--help`` and a bad argument before torch, transformers, numba or pandas load.
"""
