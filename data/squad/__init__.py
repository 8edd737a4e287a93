"""SQuAD v1.1 question answering data: examples, windowed features, span post-processing, EM/F1, demo file."""
