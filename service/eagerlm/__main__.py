"""`python -m eagerlm`: the `eagerlm` command."""

import sys

from eagerlm.service.cli.commands import main

sys.exit(main())
