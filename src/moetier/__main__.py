"""`python -m moetier` runs the command line."""

import sys

from moetier.cli import main

sys.exit(main())
