"""Rewrite the golden --quick CSVs (tests/test_golden.py). Run only in a commit that means to change a
result, and say in it which result changed and why:  python tests/golden/refresh.py"""

import gzip
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"regret": ["sims/regret.py", "--quick"], "mechanisms": ["sims/mechanisms.py", "all", "--quick"]}

for name, cmd in RUNS.items():
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, *cmd, "--out", tmp, "--quiet", "--no-figures"], cwd=ROOT, check=True)
        target = ROOT / "tests" / "golden" / name
        target.mkdir(parents=True, exist_ok=True)
        for csv in sorted(Path(tmp).glob("*.csv")):
            with open(csv, "rb") as src, gzip.GzipFile(target / f"{csv.name}.gz", "wb", mtime=0) as dst:
                shutil.copyfileobj(src, dst)
            print(f"wrote {target / csv.name}.gz")
