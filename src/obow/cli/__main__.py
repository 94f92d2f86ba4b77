"""``python -m obow.cli ...`` (as ``torchrun -m obow.cli`` runs it): the ``obow`` command."""

import sys

from obow.cli import main

sys.exit(main())
