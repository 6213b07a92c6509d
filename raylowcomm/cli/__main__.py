"""`python -m raylowcomm.cli ...`: the `raylowcomm` command, as the benchmarks and tests start it."""

import sys

from raylowcomm.cli import main

sys.exit(main())
