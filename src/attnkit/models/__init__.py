"""Pretrained models built from attnkit's modules.

``attnkit.models.bert``: BERT, loading Hugging Face checkpoints; ``load_pretrained()``
(``attnkit.models.bert_pretrained``) gives the bundled all-MiniLM-L6-v2 ready to ``encode`` texts.
``attnkit.models.llama``: a Llama-family decoder; its ``load_pretrained()`` gives the bundled
SmolLM2-135M-Instruct chat model with its tokenizer (imported on use).
``attnkit.models.classifiers``: the Iris and review classifiers of the worked examples
(imported on use).
"""

from attnkit.models.bert import BertConfig, BertModel, BertOutput
from attnkit.models.bert_pretrained import BertEncoding, PretrainedBert, load_pretrained

__all__ = [
    "BertConfig",
    "BertEncoding",
    "BertModel",
    "BertOutput",
    "PretrainedBert",
    "load_pretrained",
]
