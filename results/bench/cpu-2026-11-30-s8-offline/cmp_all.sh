for D in 64 128; do for TMA in 0 1; do for cfg in "128 64 8 3" "128 128 8 3" "128 64 4 3"; do
  set -- $cfg
  AR=0; if [ $D = 128 ] && [ $TMA = 1 ]; then AR=1; fi
  a=$(TMA=$TMA AREGS=$AR MODES=1 QT=1 timeout 900 /tmp/v36/bin/python comp.py fwd $D $1 $2 $3 $4 2>&1 | tail -1 | sed 's/.*: //')
  la=$(python3 loops.py fwd${D}_m1.sass 2>/dev/null | head -1 | awk '{print $4}')
  sed -i "s/comp.m._sigmoid_fwd_kernel = getattr(importlib.import_module(mod), fn)/comp.m._sigmoid_fwd_kernel = getattr(importlib.import_module(mod), fn)/" comp_var.py
  b=$(TMA=$TMA AREGS=$AR timeout 900 /tmp/v36/bin/python -c "
import sys, importlib; sys.path.insert(0, '/tmp'); sys.path.insert(0, '/tmp/off')
import comp
comp.m._sigmoid_fwd_kernel = importlib.import_module('k_committed')._sigmoid_fwd_kernel
r, sp, agg, sass = comp.compile_one('fwd', $D, 1, $1, $2, $3, $4)
open('/tmp/off/old.sass','w').write(sass); print('regs', r, 'spills', sp, 'total', sum(agg.values()))" 2>&1 | tail -1)
  lb=$(python3 loops.py old.sass 2>/dev/null | head -1 | awk '{print $4}')
  echo "D=$D TMA=$TMA AREGS=$AR cfg=$cfg | new(QT=1): $a loop $la | committed: $b loop $lb"
done; done; done
