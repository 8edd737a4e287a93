"""The paper's studies: the reproduction runs, their report and plots, and the scaling model."""
