# The jobs of docs/BENCHMARKS.md §24 (sourced by run_batch.sh).
echo "== E1: 16 held-out requests, before/after, micro-batches" | tee -a $R
run E1 before 3 4 $H16 16 3
run E1 after 3 4 $H16 16 3
echo "== E2: 2 ranks x 1 thread on cores 0,1" | tee -a $R
run E2 after 2 1 /tmp/dv/h8.jsonl 8 auto 0,1
run E2-one after 2 1 /tmp/dv/h3.jsonl 1 auto 0,1
run E1 after 4 3 $H16 16 4
run E1 after 4 3 $H16 16 2
run E1 after 3 4 $H16 16 2
run E1 before 4 3 $H16 16 4
