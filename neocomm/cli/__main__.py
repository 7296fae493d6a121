import sys

from neocomm.cli import main

sys.exit(main())
