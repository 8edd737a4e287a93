"""The offline corpus preparation behind `python -m data.prepare`: raw text sources to pretraining shards."""
