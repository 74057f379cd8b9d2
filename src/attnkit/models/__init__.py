"""Pretrained models built from attnkit's modules.

``attnkit.models.bert``: BERT, loading Hugging Face checkpoints; ``load_pretrained()`` gives the
bundled all-MiniLM-L6-v2 ready to ``encode`` texts. ``attnkit.models.classifiers``: the worked
examples' Iris and review classifiers (imported on use).
"""

from attnkit.models.bert import BertConfig, BertModel, BertOutput, load_pretrained
from attnkit.models.bert_pretrained import BertEncoding, PretrainedBert

__all__ = [
    "BertConfig",
    "BertEncoding",
    "BertModel",
    "BertOutput",
    "PretrainedBert",
    "load_pretrained",
]
