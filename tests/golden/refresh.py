"""Rewrite the golden --quick CSVs (tests/test_golden.py). Run only in a commit that means to change a
result, and say in it which result changed and why:  python tests/golden/refresh.py [NAME ...]"""

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import PORTABLE_NUMERICS, QUICK_RUNS, cpu_signature  # noqa: E402

for name, cmd in QUICK_RUNS.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, *cmd, "--out", tmp, "--quiet", "--no-figures"], cwd=ROOT, check=True,
                       env=os.environ | PORTABLE_NUMERICS)
        target = ROOT / "tests" / "golden" / name
        target.mkdir(parents=True, exist_ok=True)
        for csv in sorted(Path(tmp).glob("*.csv")):
            with open(csv, "rb") as src, gzip.GzipFile(target / f"{csv.name}.gz", "wb", mtime=0) as dst:
                shutil.copyfileobj(src, dst)
            print(f"wrote {target / csv.name}.gz")
        (target / "cpu.txt").write_text(cpu_signature() + "\n")        # the machine these numbers are from
