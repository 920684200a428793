"""`python -m pagedjax ...` is the `pagedjax` command."""

import sys

from pagedjax.cli import main

sys.exit(main())
