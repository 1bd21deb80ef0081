"""Running a model: a run's settings and what they build, the train step and its optimizers,
checkpoints, the run log, lock, step clock and watchdog, the lm-eval adapter; the chat engine, its
sandbox and scores, the chat page's server.
May import: archs, model, dataio, compute, configurator, and its own modules."""
