"""The worked examples: two classifiers trained end to end, and what their attention learned.

``attnkit.tasks.iris``: the tabular classifier on the Iris measurements (``train_iris``);
``attnkit.tasks.text``: review snippets, from scratch or fine-tuning the bundled MiniLM
(``train_text``); ``attnkit.tasks.registry``: re-test any checkpoint they wrote
(``evaluate_checkpoint``); ``attnkit.tasks.parallel``: ``attnkit.train.fit`` on every rank of a
``torchrun`` job; ``attnkit.tasks.runs``: what every task does around its own model (the run's
settings and checkpoint, training, the reported facts, loading it back), written once.
``attnkit train iris|text`` and ``attnkit evaluate`` run them.

These sit above the library: they combine ``attnkit.models``, ``attnkit.train``,
``attnkit.distributed`` and ``attnkit.viz``, and only the command line imports them.
"""

from attnkit.tasks.iris import IrisRun, train_iris
from attnkit.tasks.registry import TASKS, evaluate_checkpoint
from attnkit.tasks.text import TextRun, train_text

__all__ = ["TASKS", "IrisRun", "TextRun", "evaluate_checkpoint", "train_iris", "train_text"]
