"""Experiments: several training recipes (arms) x seeds from one warm start, evaluated on the same held-out
questions and compared item by item (`eviback experiment`).

    config.py   the experiment file: arms, seeds, steps, shared settings, held-out sets
    run.py      the runs, one `eviback train` process each, resumable, kept (and committed) as they finish
    compare.py  paired bootstrap differences and per-step curves (pure)
    report.py   comparison.json / .md / .html and the curves
"""

from eviback.experiment.config import Arm, ExperimentConfig, load_experiment, parse_experiment

__all__ = ["Arm", "ExperimentConfig", "load_experiment", "parse_experiment"]
