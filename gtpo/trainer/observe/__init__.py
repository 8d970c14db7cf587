"""What a run shows: the trackers' history across a resume (``metric_history``), and the recipe's additions to verl's
logging: per-token dumps and heatmaps, paper A's Table 1 validation columns, staleness beside the estimator's
metrics.
"""
