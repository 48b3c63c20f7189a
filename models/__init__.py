"""Model sources, the embedded checkpoint and the code that made it."""
