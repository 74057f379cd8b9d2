"""Models built from attnkit's modules: classifiers for the worked examples, pretrained BERT."""
