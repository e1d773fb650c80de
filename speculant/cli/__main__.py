"""`python -m speculant.cli`: the same as the `speculant` command."""
import sys

from speculant.cli.main import main

sys.exit(main())
