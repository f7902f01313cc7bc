# first sweep: difficulty and model size at a ~3 minute (uncontended) SFT budget
set -x
P=".venv/bin/python benchmarks/demo_tuning/exp_sft.py --threads 1"
$P --num-count 4 --min-count 3 --n-train 12000 --steps 900 --tag B-34x9-demo-900
$P --num-count 3 --max-number 20 --n-train 10000 --steps 900 --tag C-3x20-demo-900
$P --num-count 4 --hidden 192 --layers 4 --inter 512 --n-train 10000 --steps 1800 --tag D-4x9-h192-1800
