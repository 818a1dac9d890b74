"""Turning a module into a mixed-precision module.

- :mod:`.structure`: copies of a module tree that share its Parameters;
- :mod:`.module_level`: O2/O3, float32 islands, float32 outputs;
- :mod:`.cast_at_use`: low-precision weights every entry point sees, per thread;
- :mod:`.autocast`: the autocast level, the model's own code under ``torch.autocast``;
- :mod:`.capture`: torch.fx capture, untraceable modules become leaves;
- :mod:`.infer`: static dtype facts about a graph;
- :mod:`.insert`: cast insertion for O1;
- :mod:`.simplify`: redundant-cast removal;
- :mod:`.runtime`: the lists applied at run time to code that cannot be traced;
- :mod:`.graph`: the graph conversion, start to finish;
- :mod:`.plan`: the cast plan and ``explain``;
- :mod:`.api`: ``auto_mixed_precision``, ``custom_mixed_precision`` and the lists.

Nothing here knows about training.
"""
