"""The collectives layer's commands: ``neocomm bench``.

Each command module has ``HELP`` (its one-line help), ``add_arguments(parser)``
and ``run(args) -> int``; the ``neocomm`` dispatcher finds them through the
``neocomm.commands`` entry points. :mod:`~collectives.cli.info` adds this
layer's lines to ``neocomm info``.
"""
