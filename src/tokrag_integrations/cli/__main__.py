"""``python -m tokrag_integrations.cli``: the ``tokrag`` command."""

import sys

from . import main

sys.exit(main())
