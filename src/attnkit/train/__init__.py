"""A small training library: a seeded, resumable loop, checkpoints and data sets.

``attnkit.train.fit(model, train, val, TrainConfig(...), FitOptions(...))`` trains any classifier
(``attnkit.train.loop``); ``attnkit.train.checkpoint`` reads and writes checkpoint directories
(safetensors and JSON); ``attnkit.train.data`` loads Iris and the Rotten Tomatoes snippets. The
worked examples that ``attnkit train iris|text`` runs are ``attnkit.tasks``.
"""

from attnkit.train.loop import FitOptions, FitResult, TrainConfig, evaluate, fit, lr_at, predict

__all__ = ["FitOptions", "FitResult", "TrainConfig", "evaluate", "fit", "lr_at", "predict"]
