"""The embedding layer's commands: ``neocomm plan``, ``neocomm train`` and ``neocomm checkpoint``.

Each command module has ``HELP`` (its one-line help), ``add_arguments(parser)``
and ``run(args) -> int``; the ``neocomm`` dispatcher finds them through the
``neocomm.commands`` entry points.
"""
