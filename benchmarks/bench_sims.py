"""Wall and CPU time of the studies' commands as the README shows them, each in a fresh process into a fresh
folder (nothing resumed), with the machine beside each row: cores, the 1-minute load average before and after.

    python benchmarks/bench_sims.py                       # every command below; rows added to sim_times.csv
    python benchmarks/bench_sims.py estimators topk_bias  # some of them

A row replaces the earlier row of the same command and date. CPU time (the children's user + system) moves
less than wall time with other jobs on a shared machine; on 2 cores a run that keeps both busy takes about
half its CPU time in wall time when the machine is idle, and longer when it is not (see the load columns).
"""

import argparse
import csv
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"regret": ["sims/regret.py"], "mechanisms": ["sims/mechanisms.py", "all"],
            "rollout_spectrum": ["sims/rollout_spectrum.py"], "estimators": ["sims/estimators.py"],
            "forgetting": ["sims/forgetting.py"], "rlvr": ["sims/rlvr.py"], "flip_horizon": ["sims/flip_horizon.py"],
            "topk_bias": ["sims/topk_bias.py", "--teachers", "llm_bridge/examples/teachers.json"]}
CSV = ROOT / "benchmarks" / "sim_times.csv"
FIELDS = ["date", "study", "command", "quick", "wall_s", "cpu_s", "rc", "cores", "load_before", "load_after"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="*", default=list(COMMANDS), help=f"of {', '.join(COMMANDS)} (default all)")
    ap.add_argument("--quick", action="store_true", help="the --quick runs (topk_bias has none: its default)")
    args = ap.parse_args()
    rows = list(csv.DictReader(open(CSV))) if CSV.exists() else []
    for study in args.studies:
        cmd = COMMANDS[study] + (["--quick"] if args.quick and study != "topk_bias" else [])
        with tempfile.TemporaryDirectory() as out:
            load = os.getloadavg()[0]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, *cmd, "--out", out, "--no-figures"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        row = dict(date=datetime.date.today().isoformat(), study=study, command="python " + " ".join(cmd),
                   quick=int(args.quick), wall_s=round(wall, 1), cpu_s=round(cpu, 1), rc=rc, cores=os.cpu_count(),
                   load_before=round(load, 1), load_after=round(os.getloadavg()[0], 1))
        rows = [r for r in rows if (r["date"], r["command"]) != (row["date"], row["command"])] + [row]
        print(row, flush=True)
        with open(CSV, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
