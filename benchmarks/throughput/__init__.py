"""Training throughput of whole models: BERT and Swin steps, with FLOPs and MFU."""
