#!/usr/bin/env bash
# Prompt processing of short chat prompts, one request at a time, in two builds of llama-cpp-python
# (docs/benchmarks/kernels.md, eight requests at once): the first 8 chat prompts of scripts/bench_parallel.py, each
# rendered with the model's chat template, 1 token generated, through RANKS ranks x 1 thread, interleaved rounds. Prints
# one line per job: build, round, the median prompt tokens and the median prompt seconds of its requests (the first, a
# warm-up, left out).
#   EXACT_PYTHON=VENV_EXACT/bin/python [MODEL=...] bash scripts/experiments/bench_short_prompts.sh ROUNDS [RANKS]
set -euo pipefail
R=$1; N=${2:-2}; M=${MODEL:-smollm2-goliath-40l-f32}; W=$(mktemp -d)
python - "$W/in.jsonl" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_parallel import PROMPTS
with open(sys.argv[1], "w") as f:
    for i, p in enumerate([PROMPTS[0]] + PROMPTS[:8]):
        f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": p}], "n": 1}) + "\n")
PY
for r in $(seq "$R"); do for build in default exact; do
  py=$(command -v python); extra=(); [ $build = exact ] && py=$EXACT_PYTHON && extra=(--exact)
  rm -f "$W/o.jsonl"
  PATH="$(dirname "$py"):$PATH" timeout 300 mpiexec -n "$N" python -P -m ggpipe batch "$W/in.jsonl" -o "$W/o.jsonl" -m "$M" \
      --parallel 1 --no-progress "${extra[@]}" > "$W/log" 2>&1 || { tail -3 "$W/log"; continue; }
  python -c "
import json, statistics
rs = sorted((json.loads(l) for l in open('$W/o.jsonl')), key=lambda r: r['id'])[1:]
print('$build', $r, statistics.median(r['n_prompt'] for r in rs), round(statistics.median(r['metrics']['prompt_s'] for r in rs), 4))"
done; done
rm -rf "$W"
