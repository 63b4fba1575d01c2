"""Placeholder until the regret issue lands: `python sims/regret.py` lists what is available now."""

import sys


def main():
    import aggregation
    print("Regret sims (SPEC 3) are not implemented yet. Available now: the aggregation engine:")
    for name in aggregation.__all__:
        print(f"  aggregation.{name}")
    print("See README.md and paper_repro.md; run `make test` for the SPEC checks.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
