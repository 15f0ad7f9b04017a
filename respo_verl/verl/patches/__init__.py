"""Runtime patches of verl, one module each, named after the verl version they were written against.

Each module's docstring says why it exists and when to delete it. None is applied on import: the plugin
(:mod:`respo_verl.verl.plugin`) applies a patch only when the feature that needs it is switched on.
"""
