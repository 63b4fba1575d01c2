"""Pure functions from tidy DataFrames to matplotlib Figures, and a script that rebuilds every figure."""
