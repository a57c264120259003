"""trainer: config, data, train loop, checkpoints, trackers and the command line, on top of models and named."""
