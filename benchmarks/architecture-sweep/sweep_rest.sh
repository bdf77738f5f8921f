for t in $(cat $LIST); do
  ( ulimit -v 6000000; OMP_NUM_THREADS=1 timeout 200 .venv/bin/python benchmarks/architecture-sweep/arch_sweep.py $t 2>>benchmarks/architecture-sweep/arch_sweep.err ) >> benchmarks/architecture-sweep/arch_sweep.log || echo "$t: DIED rc $?" >> benchmarks/architecture-sweep/arch_sweep.log
done
echo DONE >> benchmarks/architecture-sweep/arch_sweep.log
