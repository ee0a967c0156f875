"""`python -m cli`: the same as the `infersmith` command."""
import sys

from cli.main import main

sys.exit(main())
