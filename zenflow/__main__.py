"""``python -m zenflow``: the machine report (``zenflow.report``)."""

import sys

from zenflow.report import main

sys.exit(main())
