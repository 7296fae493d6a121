"""The embedding layer's commands: ``neocomm plan``, ``train``, ``checkpoint`` and ``data``.

Each command module has ``HELP`` (its one-line help), ``add_arguments(parser)``
and ``run(args) -> int``; the ``neocomm`` dispatcher finds them through the
``neocomm.commands`` entry points.
"""


def positive_int(text: str) -> int:
    """An argparse type: a positive int written as one (``"3"``, not ``"3.0"`` or ``"0"``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value
