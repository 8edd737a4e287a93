"""What several test modules share, each thing defined once: test modules import from here, never from each other."""
