"""Data pipeline throughput: corpus preparation and the resumable loader."""
