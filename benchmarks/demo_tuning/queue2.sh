# second sweep: 3 numbers with a wider range (C landed just above the 30-50% band)
set -x
P=".venv/bin/python benchmarks/demo_tuning/exp_sft.py --threads 1"
$P --num-count 3 --max-number 30 --n-train 20000 --steps 900 --tag E-3x30-demo-900 --save /tmp/sft_E
