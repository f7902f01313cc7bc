# third sweep: 3-4 numbers from 1..20 (between C's 52% and B's 22%), then the same with a smaller model
set -x
P=".venv/bin/python benchmarks/demo_tuning/exp_sft.py --threads 1"
$P --num-count 4 --min-count 3 --max-number 20 --n-train 20000 --steps 900 --tag F-34x20-demo-900 --save /tmp/sft_F
$P --num-count 4 --min-count 3 --max-number 20 --n-train 20000 --steps 900 --hidden 192 --layers 4 --inter 512 --tag G-34x20-h192-900 --save /tmp/sft_G
