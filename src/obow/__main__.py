"""``python -m obow ...``: the ``obow`` command."""

import sys

from obow.cli import main

sys.exit(main())
