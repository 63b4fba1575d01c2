"""The token-level conditional analysis of aggregation/ on real causal language models (SPEC section 6)."""
