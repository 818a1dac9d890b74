"""The training wing: the step that ``build_train_network`` returns, and what it uses.

- :mod:`.build`: ``build_train_network``, options resolved into a :class:`~.step.TrainConfig`;
- :mod:`.step`: :class:`~.step.TrainStep` and its seams (:class:`~.step.StepSeam`; the
  user's :class:`~.step.StepHooks` are one);
- :mod:`.step_state`: the step's overflow ledger on the device (one read per step);
- :mod:`.scale_state`: the one loss-scale core (state in device tensors);
- :mod:`.scaling`: MindSpore's loss-scale managers (and :class:`~.scaling.NoLossScale`, no
  scaling) and functional scalers on that core;
- :mod:`.grads`: finiteness checks and fused unscaling;
- :mod:`.master`: float32 master weights for low-precision parameters.

Many processes live in :mod:`mixprec.distributed`; boost levels in :mod:`mixprec.boost`.
"""
