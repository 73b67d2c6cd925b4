"""What a training run records, in one room: MLflow (mlflow_logger.py), VisualDL (visualdl_writers.py over
visualdl_layout.py's layout), the console's events (progress.py), pipeline-stage timing and its report
(stage_timing.py, stage_report.py) and the loss plot (loss_plot.py)."""
