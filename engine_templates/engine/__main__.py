"""python -m engine_templates.engine generate|serve ... (see cli.py)."""
import sys

from engine_templates.engine.cli import main

sys.exit(main())
