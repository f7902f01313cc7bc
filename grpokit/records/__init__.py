"""The records of a training run: metric sinks, the progress display, plots and the report.

    from grpokit.records import MetricLogger, TrainProgress, plot_metrics, write_report
    log = MetricLogger("runs/x", config=cfg.model_dump())  # metrics.jsonl always; TensorBoard when installed
    log.truncate_after(resumed_step)                       # on resume: forget steps that will be redone
    with TrainProgress(total_steps, start_step=resumed_step) as prog:
        for step in range(resumed_step + 1, total_steps + 1):
            metrics = ...                                  # {"reward/mean": 0.4, "policy/kl": 0.002, ...}
            log.log(step, metrics)
            prog.update(step, metrics)
    log.close()
    plot_metrics("runs/x/metrics.jsonl", "runs/x")         # reward.png, eval.png, kl.png, clip.png,
                                                           # lengths.png

sinks.py     MetricLogger: metrics.jsonl, samples.jsonl and the trackers; resume truncation
trackers.py  TensorBoard, W&B, MLflow, trackio (one class each), run_info (versions, git commit)
progress.py  TrainProgress (live bar or compact lines), print_samples (a table of completions)
plots.py     plot_metrics, draw_plot, write_report (report.md), series
table.py     the completion table: completions.parquet, read_table, `grpokit show` (print_table)
report.py    write_html_report: the self-contained HTML page of `grpokit report` (docs/report.md)

Metric names, the file names and the one reader of metrics.jsonl (read_metrics) are
grpokit/metrics/compute.py.
"""

from grpokit.records.plots import PLOTS, PlotSpec, plot_metrics, plot_run, series, write_report
from grpokit.records.progress import DEFAULT_PROGRESS_KEYS, TrainProgress, print_samples
from grpokit.records.sinks import MetricLogger
from grpokit.records.trackers import RUN_INFO, TENSORBOARD_DIR, TRACKERS, run_info, tensorboard_available

__all__ = [
    "MetricLogger",
    "plot_run",
    "TENSORBOARD_DIR",
    "tensorboard_available",
    "TRACKERS",
    "RUN_INFO",
    "run_info",
    "TrainProgress",
    "DEFAULT_PROGRESS_KEYS",
    "print_samples",
    "plot_metrics",
    "write_report",
    "series",
    "PLOTS",
    "PlotSpec",
]
