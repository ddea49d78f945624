"""Training scripts: the embedded default model (``train.embedded_model``)."""
