"""Imported by verl in every Ray process of a ``+device=cpu`` job: calls :func:`respo_verl.cpu.runtime.enable`.

The CPU presets name this module in ``VERL_USE_EXTERNAL_MODULES`` of Ray's runtime env, and verl imports each module
named there on ``import verl``; an import is the only call verl makes into such a module. It is therefore the one
module of respo_verl whose import changes anything, and only for processes of a job that asked for the CPU.
"""

from respo_verl.cpu.runtime import enable

enable()
