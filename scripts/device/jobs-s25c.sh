# docs/BENCHMARKS.md §25, third call: one request alone under --parallel 8, --mode pipeinfer --spec-type ngram,
# with look-ahead rows forced on ("after"; GGPIPE_LOOKAHEAD=on since they default to off on one host) and without ("before", .dev/before: the scheduler of 581d0a6), pipeinfer at
# --parallel 1 and iterative, interleaved; 2 ranks x 4 threads (cores of their own), 6 held-out prompts.
echo "== L1: one request alone, 2 ranks x 4 threads" | tee -a $R
head -3 $REPO/scripts/prompts/holdout16.jsonl | cat $REPO/scripts/prompts/holdout.jsonl - > /tmp/dv/lone6.jsonl
GGPIPE_LOOKAHEAD=on MODEL=$M40 BEFORE=/tmp/dv/before bash $REPO/scripts/bench_lone_request.sh /tmp/dv/lone6.jsonl 1 2 4 | sed "s/^/L1 | /" | tee -a $R
