# The jobs of docs/BENCHMARKS.md §25 (sourced by run_batch.sh): on one host, stages that take turns with all
# its cores (-t = the CPUs, --micro-batches auto -> 1) against stages side by side (-t 1 each, 2 micro-batches),
# and llama.cpp's llama-batched-bench on the same cores; then 4 ranks x 4 threads on 16 cores, the case that
# keeps the cap of 2 micro-batches per full host.
echo "== S1: 2 cores (0,1), 8 held-out requests" | tee -a $R
run S1 after 2 1 /tmp/dv/h8.jsonl 8 auto 0,1
run S1 after 2 2 /tmp/dv/h8.jsonl 8 auto 0,1
run S1 after 1 2 /tmp/dv/h8.jsonl 8 auto 0,1
bench S1 0,1 8 2
echo "== S2: 2 cores (0,1), 16 held-out requests" | tee -a $R
run S2 after 2 1 $H16 16 auto 0,1
run S2 after 2 2 $H16 16 auto 0,1
bench S2 0,1 16 2
echo "== S3: 16 cores, 16 held-out requests" | tee -a $R
run S3 after 4 4 $H16 16 2
run S3 after 4 4 $H16 16 4
run S3 after 4 3 $H16 16 4
run S3 after 2 8 $H16 16 1
run S3 after 2 8 $H16 16 2
run S3 after 1 16 $H16 16 1
bench S3 0-15 16 16
