"""Turning a module into a mixed-precision module.

- :mod:`.structure`: copies of a module tree that share its Parameters;
- :mod:`.module_level`: O2/O3, float32 islands, float32 outputs;
- :mod:`.cast_at_use`: low-precision weights every entry point sees, per thread;
- :mod:`.autocast`: the levels that run the model's own code: the autocast level (under
  ``torch.autocast``) and O1 (under its list, applied call by call);
- :mod:`.runtime`: the list as a ``TorchFunctionMode``, one dict lookup per call;
- :mod:`.declared`: the modules a model declares float32 (transformers);
- :mod:`.emulate`: low-precision numerics on float32 kernels;
- :mod:`.plan`: the cast plan and ``explain``;
- :mod:`.api`: ``auto_mixed_precision``, ``custom_mixed_precision`` and the lists.

Nothing here knows about training.
"""
