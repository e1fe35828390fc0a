#!/usr/bin/env bash
# One request alone through `ggpipe batch` under --parallel (docs/user-guide/parallel.md, docs/benchmarks/batching.md): each prompt of a JSONL file
# run by itself, interleaved, in four variants: --mode pipeinfer --spec-type ngram at --parallel 8 with this tree
# ("after") and with an earlier one ("before", BEFORE=a worktree holding ggpipe/ and its _native*.so), pipeinfer at
# --parallel 1 ("p1"), --mode iterative at --parallel 8 ("iterative"), and "after" without look-ahead rows
# ("nolookahead": GGPIPE_LOOKAHEAD=off; with a draft model, chains the head waits for). Prints one line per run: variant, id,
# the request's tokens/s (its metrics), acceptance, drafted tokens, a hash of its tokens. DRAFT=MODEL speculates with
# that draft model instead of the n-gram lookup (--mode pipeinfer -md MODEL); PARALLEL=N sets the slots of the
# --parallel variants (default 8); MODE=NAME speculates in that mode instead of pipeinfer. TEMP=T samples at temperature T, each request seeded (seed 1): the variants' hashes
# then show whether a speculating variant decided iterative's tokens.
#   [BEFORE=DIR] [VARIANTS="before after p1 iterative"] [MODEL=...] [DRAFT=...] [MODE=...] [PARALLEL=N] [TEMP=T] \
#       bash scripts/experiments/bench_lone_request.sh PROMPTS.jsonl ROUNDS [RANKS] [THREADS]
set -euo pipefail
P=$1; R=$2; N=${3:-2}; T=${4:-1}; M=${MODEL:-smollm2-goliath-40l-f32}; W=$(mktemp -d)
python - "$P" "$W" "${TEMP:-}" <<'PY'
import json, sys
for i, line in enumerate(open(sys.argv[1])):
    r = json.loads(line)
    row = {"id": r.get("id", i), "prompt": r["prompt"]}
    if sys.argv[3]:
        row.update(temperature=float(sys.argv[3]), seed=1)
    open(f"{sys.argv[2]}/p{i}.jsonl", "w").write(json.dumps(row) + "\n")
PY
for r in $(seq "$R"); do for f in "$W"/p*.jsonl; do for v in ${VARIANTS:-before after p1 iterative}; do
  [ $v = before ] && [ -z "${BEFORE:-}" ] && continue
  pp=""; par=${PARALLEL:-8}; mode=(--mode "${MODE:-pipeinfer}" --spec-type ngram)
  [ -n "${DRAFT:-}" ] && mode=(--mode "${MODE:-pipeinfer}" -md "$DRAFT")
  [ $v = before ] && pp=$BEFORE; [ $v = p1 ] && par=1; [ $v = iterative ] && mode=(--mode iterative)
  la=${GGPIPE_LOOKAHEAD:-}; [ $v = nolookahead ] && la=off
  rm -f "$W/o.jsonl"
  GGPIPE_LOOKAHEAD=$la PYTHONPATH=${pp:+$pp:}${PYTHONPATH:-} timeout 300 mpiexec -n "$N" python -P -m ggpipe batch "$f" -o "$W/o.jsonl" -m "$M" "${mode[@]}" \
      -n 128 --ignore-eos -t "$T" --parallel $par --no-progress > "$W/log" 2>&1 || { tail -3 "$W/log"; continue; }
  python -c "
import json, hashlib; r = json.loads(open('$W/o.jsonl').readline()); m = r['metrics']
print('$v', r['id'], round(m['tokens_per_s'], 1), round(m['acceptance_rate'] or 0, 2), m['drafted'],
      hashlib.md5(json.dumps(r['tokens']).encode()).hexdigest()[:8])"
done; done; done
rm -rf "$W"
