"""``python -m neocomm ...``: the same as the ``neocomm`` command."""
import sys

from neocomm.cli import main

sys.exit(main())
