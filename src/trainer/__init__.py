"""trainer: config, data, train loop, checkpoints, trackers and the command line, on top of models and named.

Grouped by capability into sub-packages, each importing only from those below it (tests/test_imports.py):

- ``config``: the declarations of every key, reading a config, the checks on its values alone;
- ``data`` and ``checkpoint``: tokens for the steps; checkpoint files, run directories and their places;
- ``loop``: what a run is built from (checks, model, optimizer) and the loop that runs it;
- ``commands``: the command line (``named-train``, ``named-sample``, ``named-plan``, ``named-export``,
  ``named-launch``) and the commands' own work.
"""
