"""python -m figures [--results DIR] [--gallery]: rebuild every figure from the CSVs (see figures/__init__)."""

import os
import sys

from harness import Parser

from . import GALLERY_DIR, GALLERY_PAGE, VERDICT_PAGES, VERDICTS_DIR, rebuild_all, refresh_gallery, refresh_verdicts, results_folders


def main(argv=None):
    ap = Parser(prog="python -m figures", description="Rebuild every figure of every results folder from its CSVs.")
    ap.add_argument("--results", default="results",
                    help="a results folder, or a folder of them (default results/)")
    ap.add_argument("--gallery", action="store_true",
                    help=f"then copy the headline figures of RESULTS/<experiment> (figures.GALLERY) to {GALLERY_DIR}/")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.results):
        ap.error(f"--results {args.results!r} is not a folder")
    if not results_folders(args.results):
        ap.error(f"no results under {args.results!r}: run an experiment first (e.g. python sims/regret.py)")
    paths = rebuild_all(args.results, quiet=args.quiet)
    print(f"figures: {len(paths)} figures rebuilt under {args.results}", file=sys.stderr)
    if args.gallery:
        try:
            copies = refresh_gallery(args.results)
        except ValueError as exc:
            ap.error(str(exc))
        print(f"figures: {len(copies)} headline figures copied to {GALLERY_DIR}", file=sys.stderr)
        try:
            copies = refresh_verdicts(args.results)
        except ValueError as exc:
            ap.error(str(exc))
        print(f"figures: {len(copies)} verdict tables copied to {VERDICTS_DIR}; the verdict blocks of "
              f"{', '.join(VERDICT_PAGES.values())} and {GALLERY_PAGE}'s gallery regenerated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
