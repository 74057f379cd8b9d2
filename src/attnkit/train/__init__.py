"""Training for the worked examples: a seeded, resumable loop, checkpoints and data sets.

``attnkit.train.fit`` trains any classifier; ``attnkit.train.data`` loads Iris and the Rotten
Tomatoes snippets; ``attnkit.train.iris`` and ``attnkit.train.text`` are the worked examples that
``attnkit train iris|text`` runs.
"""

from attnkit.train.loop import FitResult, TrainConfig, evaluate, fit, lr_at, predict

__all__ = ["FitResult", "TrainConfig", "evaluate", "fit", "lr_at", "predict"]
