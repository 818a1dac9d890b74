"""The policy wing: what a level means, before any model is touched.

- :mod:`.levels`: the :class:`~.levels.Level` enum, the :class:`~.levels.Recipe` a level
  becomes and :func:`~.levels.resolve`, the one function from user arguments to a recipe;
- :mod:`.lists`: every default list as data (white, black, autocast's per-device lists);
- :mod:`.dtypes`: dtype spellings, device defaults, the slow-dtype warning;
- :mod:`.hardware`: what a device runs natively (:func:`~.hardware.is_native`);
- :mod:`.ops`: op keys and the cast helpers every wing shares.
"""
