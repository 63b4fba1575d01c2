#!/bin/bash
# Wall time of each sim's --quick run (issue 34: "--quick finishes in seconds"), one after another into a fresh
# folder (nothing resumed), written to results/quick_runs.csv with the load average before and after.
#   bash benchmarks/quick_runs.sh
# Run it twice on a fresh clone to see the numba compile of the first run apart from the run itself.
cd "$(dirname "$0")/.." || exit 2
out=$(mktemp -d)
csv=results/quick_runs.csv
mkdir -p results
echo "date,sim,seconds,rc,load_before,load_after" > "$csv"
for s in regret "mechanisms all" rollout_spectrum estimators forgetting rlvr flip_horizon; do
  name=${s%% *}
  load0=$(cut -d' ' -f1 /proc/loadavg)
  t0=$(date +%s.%N)
  .venv/bin/python "sims/$name.py" ${s#"$name"} --quick --out "$out/$name" --quiet > "$out/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  echo "$(date +%F),$name,$(python3 -c "print(round($t1 - $t0, 1))"),$rc,$load0,$(cut -d' ' -f1 /proc/loadavg)" >> "$csv"
done
rm -rf "$out"
cat "$csv"
