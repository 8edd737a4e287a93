"""Benchmarks and reproduction studies (not tests); each prints ratios against a named reference."""
