"""The ``glmport`` commands, one module each: every module declares its command's flags
(``add_parser``) and runs it. :mod:`glmport.commands.common` holds what several share:
the argument types, the flag declarations, the checks made before any work and the
model loader. :mod:`glmport.cli` assembles the parser and owns the error-line policy.
"""
