#!/usr/bin/env bash
# A whole `ggpipe batch` job, interleaved round by round across variants (docs/benchmarks/many-requests.md): this tree at
# each --parallel of PARALLEL, and, with BEFORE=DIR (a worktree of an earlier commit holding ggpipe/ and its
# _native*.so), that tree at the same values. Prints one line per run: variant, generated tokens, tokens/s over the
# trace's span (first stage's first run to the last stage's last run, scripts/trace_rows.py) and over the wall
# time with start-up, at most (generated tokens over the busiest stage's run seconds: the rate if that stage had never
# waited, docs/benchmarks/many-requests.md, What bounds it on two cores), TTFT p50/p90 over the records
# (ttft_wall_s), a hash of every record's tokens.
#   [BEFORE=DIR] [PARALLEL="8"] [MODEL=...] [EXTRA="--ignore-eos"] bash scripts/experiments/bench_batch_ab.sh IN.jsonl ROUNDS [RANKS] [THREADS]
set -euo pipefail
IN=$1; R=$2; N=${3:-2}; T=${4:-1}; M=${MODEL:-smollm2-goliath-40l-f32}; W=$(mktemp -d)
HERE=$(cd "$(dirname "$0")/.." && pwd)   # scripts/: trace_rows.py
for r in $(seq "$R"); do for p in ${PARALLEL:-8}; do for v in before after; do
  [ $v = before ] && [ -z "${BEFORE:-}" ] && continue
  pp=""; [ $v = before ] && pp=$BEFORE
  rm -rf "$W/tr" "$W/o.jsonl"
  s=$(date +%s.%N)
  PYTHONPATH=${pp:+$pp:}${PYTHONPATH:-} GGPIPE_TRACE_DIR="$W/tr" timeout 900 mpiexec -n "$N" python -P -m ggpipe batch "$IN" \
      -o "$W/o.jsonl" -m "$M" --parallel "$p" -t "$T" -n 128 --no-progress ${EXTRA:-} > "$W/log" 2>&1 || { tail -3 "$W/log"; continue; }
  e=$(date +%s.%N)
  python - "$v --parallel $p round $r" "$W" "$s" "$e" "$HERE" <<'PY'
import hashlib, json, statistics, sys
sys.path.insert(0, sys.argv[5])
from trace_rows import summary
name, w, s, e = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
recs = [json.loads(line) for line in open(f"{w}/o.jsonl")]
gen = sum(len(x["tokens"]) for x in recs)
tt = sorted(x["metrics"]["ttft_wall_s"] for x in recs)
h = hashlib.sha1(json.dumps(sorted((x["id"], x["tokens"]) for x in recs)).encode()).hexdigest()[:8]
sm = summary(f"{w}/tr")
print(f"{name}: {gen} tokens, {gen / sm['seconds']:.1f} tok/s over {sm['seconds']:.2f} s of runs, "
      f"{gen / (e - s):.1f} with start-up ({e - s:.1f} s), at most {gen / max(sm['work_s']):.1f} "
      f"(runs {'/'.join(f'{x:.2f}' for x in sm['work_s'])} s), TTFT p50 {1e3 * statistics.median(tt):.0f} ms "
      f"p90 {1e3 * tt[int(0.9 * (len(tt) - 1))]:.0f} ms, tokens {h}", flush=True)
PY
done; done; done
rm -rf "$W"
