"""The training run: what it is built from and the loop that runs it.

- ``checks``: every check that needs the devices, the tokenizer or the model's shapes
  (``checked_setup``, shared with ``named-plan``), and the ``Setup`` they build;
- ``registry``, ``model_init``, ``optim``: the model class, the model a run starts from, the optimizer;
- ``loss``, ``train``: the train step and the loop (``build_run`` gives the ``Run``, ``train`` runs it);
- ``cadence``, ``validation``: what is due after each step, the metrics read off the device with the
  NaN policy, throughput; the validation loss, per source of a mixture;
- ``generate``: text from a model, for the loop's samples and ``named-sample``;
- ``harness``: lm-evaluation-harness tasks on a model, for ``trainer.eval_harness_*`` and ``named-eval``
  (imports lm-eval, an optional extra: imported only when tasks are asked for);
- ``trackers``, ``stop``: metrics and logs, stop signals and timed saves agreed across processes;
- ``distributed``, ``hardware``: multi-process start-up, and what each accelerator can do.

Below it lie ``config``, ``data`` and ``checkpoint``; above it, ``commands``.
"""
