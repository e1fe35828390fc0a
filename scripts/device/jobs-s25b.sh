# docs/BENCHMARKS.md §25, second call: the cap of 2 micro-batches on a host whose stages' threads fill its CPUs
# (4 ranks x 4 threads on 16 cores, 16 held-out requests), unpinned and pinned 4 cores a rank, interleaved,
# twice; and stages that take turns with all 16 cores (2 x 16, 1 micro-batch) against side by side (2 x 8).
echo "== C1: 16 cores, 16 held-out requests, 4 ranks x 4 threads" | tee -a $R
for i in 1 2; do
  run C1 after 4 4 $H16 16 2
  run C1 after 4 4 $H16 16 4
  MPIARGS="-bind-to core:4" run C1 after 4 4 $H16 16 2
  MPIARGS="-bind-to core:4" run C1 after 4 4 $H16 16 4
done
echo "== C2: 16 cores, 16 held-out requests, 2 ranks" | tee -a $R
run C2 after 2 8 $H16 16 2
run C2 after 2 16 $H16 16 1
run C2 after 1 16 $H16 16 1
