"""Built-in tasks: data, reward functions and small shipped models, so that a
flow runs and learns with no download."""
