"""`python -m bench`: the benchmark CLI (also how the benchmark starts its child processes)."""

import sys

from bench.main import main

sys.exit(main())
