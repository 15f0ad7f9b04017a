"""Version-keyed runtime patches of megatron-core, one module per patch (``megatron_core_<version>_<what>.py``).

Each module's docstring is its header: the megatron-core version it was written against, why it exists and when to
delete it. None is applied on import; callers apply them explicitly.
"""
