"""The topology layer's commands: ``neocomm topo`` and ``neocomm fabric``.

Each command module has ``HELP`` (its one-line help), ``add_arguments(parser)``
and ``run(args) -> int``; the ``neocomm`` dispatcher finds them through the
``neocomm.commands`` entry points.
"""
