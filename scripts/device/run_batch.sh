#!/bin/bash
# ggpipe batch jobs on the workplace's lent 16-core machine, in one call of the device tool, from the bundle
# scripts/device/make_bundle.sh writes (.dev/). Writes $OUT/log.txt and $OUT/results.txt (one line per job:
# trace rows/s, each stage's busy share, tokens and a hash of them). "before" jobs run an earlier scheduler
# (.dev/before/ggpipe/..., files copied over a copy of this tree) when .dev/before exists. The jobs are a
# file of this folder (JOBS=scripts/device/jobs-....sh; default: those of docs/BENCHMARKS.md §24).
# Two traps met there (docs/BENCHMARKS.md §24): the machine's own Open MPI is found by mpi4py before the
# carried MPICH unless MPI4PY_LIBMPI names it (each rank then runs alone, as a world of one: the check below
# refuses that); and pip --target drops the mpich wheel's lib/, so its libraries are unpacked by hand.
set +e
export PYTHONUNBUFFERED=1
REPO=$(pwd); D=$REPO/.dev; rm -rf /tmp/dv; mkdir -p /tmp/dv
exec > >(tee $OUT/log.txt) 2>&1
date; nproc; lscpu | grep -E "Model name|Socket|NUMA node|Thread|L3"; free -g | head -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dv/site $D/whl/*.whl || exit 1
tar -C /tmp/dv/site -xJf $D/llama_cpp.tar.xz || exit 1
python3 -c "
import zipfile, glob, os
z = zipfile.ZipFile(glob.glob('$D/whl/mpich-*.whl')[0])
pre = 'mpich-5.0.2.data/data/lib/'
for n in z.namelist():
    if n.startswith(pre) and not n.endswith('/') and z.getinfo(n).file_size > 100:
        out = '/tmp/dv/lib/' + n[len(pre):]
        os.makedirs(os.path.dirname(out), exist_ok=True)
        open(out, 'wb').write(z.read(n))" || exit 1
export LD_LIBRARY_PATH=/tmp/dv/lib:/tmp/dv/lib/mpich${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} MPI4PY_LIBMPI=/tmp/dv/lib/libmpi.so.12
mkdir -p /tmp/dv/bin; printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/dv/bin/python; chmod +x /tmp/dv/bin/python   # the jobs run `python -P -m ggpipe` (a venv's python3: a wrapper, not a link)
export PYTHONPATH=$REPO:/tmp/dv/site PATH=/tmp/dv/bin:/tmp/dv/site/bin:$PATH GGPIPE_CACHE=/tmp/dv/gcache
which mpiexec; python3 -c "import mpi4py.MPI as M, llama_cpp, ggpipe._native; print(M.Get_library_version()[:40])" || exit 1
mpiexec -n 2 python3 -c "from mpi4py import MPI; c = MPI.COMM_WORLD; open('/tmp/dv/ws%d' % c.Get_rank(), 'w').write(str(c.Get_size()))" < /dev/null; sz=$(cat /tmp/dv/ws0 /tmp/dv/ws1); echo "world size $sz"; [ "$sz" = 22 ] || exit 1
mkdir -p /tmp/dv/gcache/models; xz -dc $D/smol2.gguf.xz > /tmp/dv/smol2.gguf; [ -f $D/llama-batched-bench.xz ] && xz -dc $D/llama-batched-bench.xz > /tmp/dv/llama-batched-bench && chmod +x /tmp/dv/llama-batched-bench
M40=/tmp/dv/gcache/models/goliath-shaped-40l-f32.gguf
t0=$(date +%s); python3 -c "
from ggpipe.models.derive import derive_gguf
derive_gguf('/tmp/dv/smol2.gguf', [0, 1] * 20, '$M40', 'f32')" || exit 1
echo "derived in $(( $(date +%s) - t0 )) s: $(ls -la $M40)"
if [ -d $D/before ]; then cp -r $REPO /tmp/dv/before; cp -r $D/before/. /tmp/dv/before/; fi
R=$OUT/results.txt
run() {  # run NAME VERSION(before|after) RANKS THREADS PROMPTS PARALLEL M [taskset cpus]
  local name=$1 v=$2 n=$3 t=$4 p=$5 par=$6 m=$7 cpus=$8 pp=$REPO
  [ $v = before ] && pp=/tmp/dv/before
  rm -rf /tmp/dv/tr /tmp/dv/o.jsonl
  local pre=""; [ -n "$cpus" ] && pre="taskset -c $cpus"
  local s=$(date +%s.%N)
  PYTHONPATH=$pp:/tmp/dv/site GGPIPE_TRACE_DIR=/tmp/dv/tr timeout 200 $pre mpiexec ${MPIARGS:-} -n $n python -P -m ggpipe batch $p -o /tmp/dv/o.jsonl \
     -m $M40 -n ${NTOK:-128} --ignore-eos --parallel $par -t $t --micro-batches $m > /tmp/dv/batch.log 2>&1
  local rc=$? e=$(date +%s.%N)
  local rows=$(PYTHONPATH=$REPO:/tmp/dv/site python3 $REPO/scripts/trace_rows.py /tmp/dv/tr 2>&1 | tail -1)
  local gen=$(python3 -c "import json,hashlib; rs=[json.loads(l) for l in open('/tmp/dv/o.jsonl')]; print(sum(len(r['tokens']) for r in rs), hashlib.md5(json.dumps(sorted((r['id'],r['tokens']) for r in rs)).encode()).hexdigest()[:8])" 2>&1 | tail -1)
  echo "$name | $v | ${n}x$t${MPIARGS:+ $MPIARGS} | par $par | M $m | rc $rc | wall $(python3 -c "print(round($e-$s,2))") s | $rows | tokens+hash $gen" | tee -a $R
  [ $rc = 0 ] || tail -5 /tmp/dv/batch.log
}
bench() {  # bench NAME CPUS NPL THREADS: llama.cpp's llama-batched-bench (when carried) on the same model and cores
  [ -x /tmp/dv/llama-batched-bench ] || return 0
  taskset -c $2 /tmp/dv/llama-batched-bench -m $M40 -c 4096 -b 512 -ub 512 -npp 64 -ntg ${NTOK:-128} -npl $3 -t $4 \
    -fa off 2>&1 | grep -E "^\|\s+[0-9]" | sed "s/^/$1 | llama-batched-bench -t $4 cpus $2 | /" | tee -a $R
}
P16=$REPO/scripts/prompts/many16.jsonl; H16=$REPO/scripts/prompts/holdout16.jsonl
head -8 $H16 > /tmp/dv/h8.jsonl
head -3 $H16 > /tmp/dv/h3.jsonl
source ${JOBS:-$REPO/scripts/device/jobs-s24.sh}
date
