"""The embedding layer's commands: ``neocomm plan``, ``train``, ``checkpoint`` and ``data``.

Each command module has ``HELP`` (its one-line help), ``add_arguments(parser)``
and ``run(args) -> int``; the ``neocomm`` dispatcher finds them through the
``neocomm.commands`` entry points.
"""
